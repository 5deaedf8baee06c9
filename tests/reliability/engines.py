"""Real vLLM engines for the end-to-end reliability tests, one process each (``tests/e2e/driver.py``).

Every engine runs with ``PYTHONHASHSEED=0`` (shared block hashes), one reserved CPU and
a 1 GiB CPU KV cache (several engines run at once on the small test machines), and
writes pykv's counters through ``PYKV_STATS_FILE`` so tests see where KV came from.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from pykv.config import PykvConfig

TESTS = Path(__file__).resolve().parents[1]
DRIVER = TESTS / "e2e" / "driver.py"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def tiny_model_work(tmp_path_factory, name: str) -> Path:
    """A fresh work directory holding the tiny random Llama as ``model`` (engines find it there)."""
    from pykv.jobs.tiny_model import make_tiny_llama
    work = tmp_path_factory.mktemp(name)
    make_tiny_llama(work / "model")
    return work


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the driver can read the engine's KV cache ("kv_digest")


def env(work: Path, name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYKV_STATS_FILE": str(work / f"{name}.stats"), **(extra or {})}


def start(work: Path, name: str, ktc: dict | None, steps: list[dict], engine: dict | None = None,
          extra_env: dict[str, str] | None = None, prelude: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start an engine process playing ``steps``; ``prelude``: test glue run in it before the engine
    starts (it can import the test helpers)."""
    plan = {"model": str(work / "model"), "kv_transfer_config": ktc, "steps": steps, "engine": engine or {},
            "prelude": with_test_helpers(prelude) if prelude else None}
    (work / f"{name}.plan.json").write_text(json.dumps(plan))
    out = work / f"{name}.out.json"
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(work / f"{name}.plan.json"), str(out)],
                            env=env(work, name, extra_env), stdout=log, stderr=subprocess.STDOUT, cwd=work)
    return proc, out


def finish(proc: subprocess.Popen, out: Path, timeout: float = 900) -> dict:
    rc = proc.wait(timeout=timeout)
    log = out.with_name(out.name.replace(".out.json", ".log"))
    assert rc == 0, f"engine failed (rc {rc}); see {log}:\n" + log.read_text()[-4000:]
    return json.loads(out.read_text())


def log_of(work: Path, name: str) -> str:
    return (work / f"{name}.log").read_text()


def log_errors(work: Path, name: str) -> list[str]:
    """Uncaught tracebacks and ERROR lines in an engine's log. vLLM logs one harmless traceback as a
    WARNING in every engine (no tokenizer with ``skip_tokenizer_init``): logged lines are prefixed."""
    return [line for line in log_of(work, name).splitlines()
            if line.startswith("Traceback") or " ERROR " in line or "pykv: error" in line]


def gen(name: str, prompt: list[int], max_tokens: int = 8) -> dict:
    return {"op": "generate", "name": name, "prompts": [prompt], "max_tokens": max_tokens}


def kv_digest(name: str, of: str, blocks: int, codec: str | None = None) -> dict:
    """Digests of the first ``blocks`` engine blocks of step ``of``'s request (in-process engines);
    ``codec``: of the KV that lossy codec gives back for them (``KVPages.digests``)."""
    return {"op": "kv_digest", "name": name, "of": of, "blocks": blocks, **({"codec": codec} if codec else {})}


def settle(work: Path, engine: str) -> dict:
    return {"op": "settle", "stats": str(work / f"{engine}.stats"), "timeout": 60}


def snap(work: Path, engine: str, name: str) -> dict:
    return {"op": "snapshot", "name": name, "stats": str(work / f"{engine}.stats")}


def mark(name: str) -> dict:
    return {"op": "mark", "name": name}


def run_code(code: str) -> dict:
    """An ``exec`` step that can import the reliability helpers."""
    return {"op": "exec", "code": with_test_helpers(code)}


def with_test_helpers(code: str) -> str:
    """``code`` preceded by what lets it import the test helpers (``worker_helpers``, ``reliability``)."""
    return f"import sys; sys.path.insert(0, {str(TESTS)!r})\n{code}"


def ktc(root: Path | list[Path], block_tokens: int = 256, **keys) -> dict:
    """The kv-transfer config of a pykv engine on ``root`` (a list: ``roots``, one per device)."""
    where = {"roots": [str(r) for r in root]} if isinstance(root, list) else {"root": str(root)}
    for directory in root if isinstance(root, list) else [root]:  # as `pykv init` makes them: an engine never does
        if not os.path.lexists(directory):
            os.makedirs(directory)
    config = PykvConfig.from_extra_config({**where, "staging_bytes": "16M", **keys})
    return config.to_kv_transfer_config(block_tokens)


def counter(result: dict, snapshot: str, key: str, process: str = "worker0") -> int:
    return result[snapshot].get(process, {}).get(key, 0)


# -- the same-path oracle ----------------------------------------------------------------------------
REFERENCE_ENGINE = {"enable_prefix_caching": True}


def reference_steps(sequence: list[tuple[str, list[int]]]) -> list[dict]:
    """Steps for a reference engine (no connector, vLLM's own prefix cache on): each ``(name, prompt)``
    in order, so a repeated prompt (or one sharing a prefix with an earlier one) hits vLLM's cache."""
    return [gen(f"{name}#{i}", prompt) for i, (name, prompt) in enumerate(sequence)]


class SamePath:
    """The oracle for token comparisons: what a no-connector engine with vLLM's prefix cache produced
    for the same prompt with exactly the same number of cached tokens (0: a cold prefill).

    A random bf16 model's output after a prefix hit need not equal a cold prefill's, so a pykv hit
    of H tokens is compared with a prefix-cache hit of H tokens: the same KV (computed by the same
    cold prefill) and the same computation of the rest. Prompt lengths are chosen so both caches
    hit the same length (pykv: whole storage blocks; vLLM: whole 32-token blocks)."""

    def __init__(self, result: dict):
        self.by_prompt: dict[str, dict[int, list[int]]] = {}
        self.kv: dict[str, list[str]] = {}  # a prompt's KV block digests from its cold run, where a test reads them
        for step, outputs in result.items():
            if "#" not in step or not (isinstance(outputs, list) and outputs and isinstance(outputs[0], dict)):
                continue
            name, out = step.split("#")[0], outputs[0]
            known = self.by_prompt.setdefault(name, {})
            cached, got = out["num_cached_tokens"], out["tokens"]
            assert known.setdefault(cached, got) == got, f"reference {name} at {cached} cached tokens differs from itself"

    def at(self, name: str, cached: int) -> list[int]:
        known = self.by_prompt.get(name, {})
        assert cached in known, f"{name}: no reference run with {cached} cached tokens (has {sorted(known)})"
        return known[cached]

    def cold(self, name: str) -> list[int]:
        return self.at(name, 0)

    def same_path(self, name: str, output: dict) -> list[int]:
        """The reference for ``output`` (a driver result entry): same prompt, same hit length."""
        return self.at(name, output["num_cached_tokens"])
