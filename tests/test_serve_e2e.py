"""Serving as users serve: ``pykv warm``, then ``pykv serve`` (vLLM's OpenAI server) on the tiny model.

The real server runs on 127.0.0.1 (a free port) and is asked over HTTP (urllib)
with token-id prompts (the tiny model has no tokenizer). One warm run stores
prompt A with the documented flags; server 1 (same flags) hits it on its first
request and stores prompt B; after a restart, server 2 (with ``max_tree_bytes``) hits B
too. ``/metrics`` is scraped before the first request (every ``pykv:*`` counter present
at 0, every metric of the Grafana dashboard present) and after (server 2's gauges show
the tree its eviction rounds found). Every server runs in its own process group, killed
whole on any failure; every file lives under pytest's ``tmp_path`` (``TMPDIR`` too,
checked empty after).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from dashboard import dashboard_metric_names, exposition_samples  # noqa: E402

from pykv.connector.spec import METRIC_DOCS  # noqa: E402
from pykv.jobs.tiny_model import make_tiny_llama  # noqa: E402

#: The flags docs/cli.md gives `pykv serve` and `pykv warm` alike for a model without a tokenizer.
ENGINE_FLAGS = ["--skip-tokenizer-init", "--enforce-eager"]
STARTUP_S = 400


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPT_A, PROMPT_B = tokens(1, 1000), tokens(2, 1000)
SHORT = tokens(3, 40)  # shorter than a storage block: stores nothing
LIMIT = 1 << 30  # server 2's max_tree_bytes: far above the tree, evicts nothing
HIT_TOKENS = 768  # three whole 256-token storage blocks of a 1,000-token prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pykv(*args: object) -> list[str]:
    return [sys.executable, "-m", "pykv.commands", *map(str, args)]


@contextlib.contextmanager
def server(work: Path, model: Path, root: Path, name: str, *settings: str) -> Iterator[str]:
    """`pykv serve` (``--set`` each of ``settings``) in a process group of its own; yields its base URL;
    kills the group on exit."""
    port = free_port()
    log = open(work / f"{name}.log", "w")
    sets = [arg for setting in settings for arg in ("--set", setting)]
    proc = subprocess.Popen(pykv("serve", model, "--root", root, *sets, "--host", "127.0.0.1", "--port", port,
                                 "--enable-prompt-tokens-details", *ENGINE_FLAGS),
                            env=work_env(work), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"{name} exited ({proc.returncode}): {tail(work / f'{name}.log')}"
            assert time.monotonic() < deadline, f"{name} did not start in {STARTUP_S}s: {tail(work / f'{name}.log')}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # engine core and helpers too, whatever state they are in
        proc.wait()
        log.close()


def work_env(work: Path) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env.pop("PYTHONHASHSEED", None)  # pykv serve and pykv warm both default it to 0
    return env


def tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-15:])


def complete(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


MODEL_NAME: list[str] = []  # the served model's name (its path), set by the fixture


def cached_tokens(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return response.read().decode()


def metrics(url: str, text: str | None = None) -> dict[str, float]:
    """``pykv:*`` counters of ``/metrics`` (Prometheus's ``<name>_total`` samples, summed over labels)."""
    text = scrape(url) if text is None else text
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        if sample.startswith("pykv:") and sample.endswith("_total"):
            name = sample.removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("serve")
    (work / "tmp").mkdir()
    model = make_tiny_llama(work / "model")
    MODEL_NAME[:] = [str(model)]
    root = work / "tree"
    root.mkdir()  # as `pykv init` makes it: no pykv command or engine creates a root
    prompts = work / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": PROMPT_A}) + "\n")
    out: dict = {}
    dry = subprocess.run(pykv("warm", prompts, "--model", model, "--root", root, "--json", "--dry-run",
                              *ENGINE_FLAGS), env=work_env(work), capture_output=True, text=True)
    out["dry"], out["dry_root_entries"] = dry, sorted(p.name for p in root.iterdir())
    out["warm"] = subprocess.run(pykv("warm", prompts, "--model", model, "--root", root, "--json",
                                      *ENGINE_FLAGS), env=work_env(work), capture_output=True, text=True)
    out["files_after_warm"] = len(block_files(root))
    out["tmp_left"] = sorted(p.name for p in (work / "tmp").iterdir())  # by the warm runs
    with server(work, model, root, "server1") as url:
        out["text_at_start"] = scrape(url)
        out["metrics_at_start"] = metrics(url, out["text_at_start"])
        out["a1"] = complete(url, PROMPT_A)
        out["b1"] = complete(url, PROMPT_B)
        deadline = time.monotonic() + 60
        while len(block_files(root)) < 6 and time.monotonic() < deadline:  # B's blocks published
            time.sleep(0.5)
        out["metrics_1"] = metrics(url)
    with server(work, model, root, "server2", f"max_tree_bytes={LIMIT}", "evict_interval=1s") as url:
        out["text_at_start_2"] = scrape(url)
        out["metrics_at_start_2"] = metrics(url, out["text_at_start_2"])
        out["b2"] = complete(url, PROMPT_B)
        out["metrics_2"] = metrics(url)
        time.sleep(2.5)  # an eviction round after b2, and the gauges due again (they ride on a step's stats)
        complete(url, SHORT)
        out["gauges_2"] = exposition_samples(scrape(url))
    out["blocks"] = [(os.stat(p).st_size, os.stat(p).st_blocks * 512) for p in block_files(root)]
    out["inspect"] = json.loads(subprocess.run(pykv("inspect", root, "--json"), capture_output=True,
                                               text=True, check=True).stdout)
    return out


def test_warm_dry_run_creates_nothing(runs):
    assert runs["dry"].returncode == 0, runs["dry"].stderr
    assert json.loads(runs["dry"].stdout)["chunks_stored"] == 3
    assert runs["dry_root_entries"] == []  # not even the tree's marker


def test_warm_stores_what_a_server_with_the_same_flags_hits(runs):
    assert runs["warm"].returncode == 0, runs["warm"].stderr
    assert json.loads(runs["warm"].stdout)["chunks_stored"] == 3 and runs["files_after_warm"] == 3
    assert cached_tokens(runs["a1"]) == HIT_TOKENS
    assert runs["metrics_1"]["pykv:load_hits_disk"] >= 3


def test_a_restarted_server_hits_what_the_first_stored(runs):
    assert cached_tokens(runs["b1"]) == 0
    assert cached_tokens(runs["b2"]) == HIT_TOKENS
    assert runs["metrics_2"]["pykv:load_hits_disk"] == 3
    assert runs["b2"]["choices"][0]["text"] is not None


def test_every_pykv_counter_is_exported_from_the_start(runs):
    for snapshot in ("metrics_at_start", "metrics_at_start_2"):
        assert set(runs[snapshot]) == set(METRIC_DOCS), runs[snapshot]
        assert all(value == 0 for value in runs[snapshot].values()), runs[snapshot]


def test_every_dashboard_metric_is_on_metrics_from_the_start(runs):
    for text in ("text_at_start", "text_at_start_2"):
        assert dashboard_metric_names() <= set(exposition_samples(runs[text])), text


def test_the_gauges_show_the_tree_the_eviction_rounds_found(runs):
    start, later = exposition_samples(runs["text_at_start"]), runs["gauges_2"]
    assert [v for _, v in start["pykv:tree_limit_bytes"]] == [0]  # server 1: no max_tree_bytes, no rounds
    assert math.isnan(start["pykv:tree_bytes"][0][1])

    def value(name: str) -> float:
        [(labels, v)] = later[name]
        assert labels["device"] == "0"
        return v

    [(info, one)] = later["pykv:device_info"]
    assert one == 1 and Path(info["root"]).name == "tree"
    assert value("pykv:tree_limit_bytes") == LIMIT and value("pykv:evict_behind") == 0
    assert value("pykv:tree_blocks") == len(runs["blocks"]) == 6
    assert value("pykv:tree_bytes") == sum(min(size, allocated) for size, allocated in runs["blocks"])
    assert (value("pykv:quarantine_files"), value("pykv:quarantine_bytes")) == (0, 0)
    assert 0 <= value("pykv:evict_round_age_seconds") < 30


def test_one_namespace_for_warm_and_both_servers(runs):
    spaces = [ns for ns in runs["inspect"]["namespaces"] if ns["id"]]
    assert len(spaces) == 1 and spaces[0]["files"] == 6


def test_warm_leaves_nothing_in_the_temp_directory(runs):
    assert runs["tmp_left"] == []
