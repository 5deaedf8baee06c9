from __future__ import annotations

from pathlib import Path

import typer

from pykv.commands.app import app
from pykv.commands.completions import DOCS_BEGIN, DOCS_END, FILES, describe, main, render_all, update_docs

REPO = Path(__file__).resolve().parent.parent
REGENERATE = "python -m pykv.commands.completions --write completions/ --docs docs/cli.md"


def test_committed_completions_match_the_cli():
    files, _ = render_all()
    for name, text in files.items():
        assert (REPO / "completions" / name).read_text() == text, f"completions/{name} is stale: run {REGENERATE}"


def test_committed_docs_match_the_cli():
    _, generated = render_all()
    current = (REPO / "docs" / "cli.md").read_text()
    assert update_docs(current, generated) == current, f"docs/cli.md is stale: run {REGENERATE}"


def test_every_command_and_option_appears_everywhere():
    _, commands = describe(app)
    files, docs = render_all()
    assert {c.name for c in commands} >= {"inspect", "gc", "fsck"}
    for command in commands:
        for text in [*files.values(), docs]:
            assert command.name in text
        for option in command.options:
            for opt in option.opts:
                assert opt in files[FILES["bash"]] and opt in files[FILES["zsh"]] and opt in docs
                assert f"-l {opt[2:]}" in files[FILES["fish"]]


def test_generator_picks_up_newly_registered_commands():
    extra = typer.Typer()
    extra.command("gc")(lambda root: None)

    def bench(sizes: str = typer.Option("1M", "--sizes", help="Block sizes.")) -> None:
        """Time reads and writes."""

    extra.command("bench")(bench)
    _, commands = describe(extra)
    assert [c.name for c in commands] == ["gc", "bench"]
    assert [o.opts for o in commands[1].options] == [("--sizes",), ("--help",)]


def test_update_docs_keeps_hand_written_text():
    existing = f"# intro\n\n{DOCS_BEGIN}\nold\n{DOCS_END}\n\n## notes\n"
    assert update_docs(existing, f"{DOCS_BEGIN}\nnew\n{DOCS_END}") == f"# intro\n\n{DOCS_BEGIN}\nnew\n{DOCS_END}\n\n## notes\n"


def test_main_writes_files(tmp_path):
    docs = tmp_path / "cli.md"
    assert main(["--write", str(tmp_path / "out"), "--docs", str(docs)]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(FILES.values())
    assert DOCS_BEGIN in docs.read_text()


def test_files_complete_where_a_file_is_expected_and_choices_where_there_are_choices():
    files, _ = render_all()
    bash_text = files[FILES["bash"]]
    warm = bash_text[bash_text.index("        warm)"):]
    assert "--root|--roots) COMPREPLY=($(compgen -d" in warm  # a directory
    assert 'COMPREPLY=($(compgen -f -- "$cur"))' in warm.split(";;\n        ", 1)[0] or \
        'compgen -f' in warm  # the prompt file
    config = bash_text[bash_text.index("        config)"):]
    assert '--dram-policy) COMPREPLY=($(compgen -W "lru arc"' in config
    assert '--verify) COMPREPLY=($(compgen -W "full header"' in config
    calibrate = bash_text[bash_text.index("        calibrate)"):]
    assert "--out) COMPREPLY=($(compgen -f" in calibrate
    assert "--dram-policy[" in files[FILES["zsh"]] and ":lru|arc:(lru arc)" in files[FILES["zsh"]]
    assert "-l dram-policy -r -a 'lru arc'" in files[FILES["fish"]]
    assert "-l out -r -F" in files[FILES["fish"]]


def test_completions_install_writes_where_the_shell_looks(tmp_path, monkeypatch):
    from typer.testing import CliRunner
    monkeypatch.setenv("HOME", str(tmp_path))
    for shell, relative in (("bash", ".local/share/bash-completion/completions/pykv"), ("zsh", ".zfunc/_pykv"),
                            ("fish", ".config/fish/completions/pykv.fish")):
        result = CliRunner().invoke(app, ["completions", "install", "--shell", shell], env={"HOME": str(tmp_path)})
        assert result.exit_code == 0, result.output
        assert (tmp_path / relative).read_text() == render_all()[0][FILES[shell]]
    shown = CliRunner().invoke(app, ["completions", "show", "--shell", "fish"])
    assert shown.stdout == render_all()[0][FILES["fish"]]
