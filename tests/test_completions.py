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
