"""Warm a pykv tree: compute and store the KV of a prompt set so later requests hit.

``pykv warm`` (``pykv.commands.warm``) reads and checks the prompt file itself
(``read_prompts``: no vLLM needed, so a bad line fails at once), then runs this
module in a subprocess (``python -m pykv.connector.warm PLAN RESULT PROGRESS``)
with ``PYTHONHASHSEED`` set, since vLLM's engine must start under a ``__main__``
guard (``run_warm`` does that for library users too). ``warm`` needs one vLLM
engine with pykv in-process (so it can ask pykv's manager what is on disk); for
each prompt it:

- computes its storage-block keys the way vLLM does (chained prefix hashes of
  ``tokens_per_hash`` tokens, the hash of each storage block's last engine block);
- skips it when every full block is already in the tree (resumable: a re-run
  stores nothing new and reads nothing), or when its full blocks are shorter
  than the disk tier's break-even length (a load would be refused anyway);
- otherwise prefills it (``max_tokens=1``); vLLM stores the new blocks through
  the connector (and loads the ones already present).

With ``dry_run`` nothing is generated and nothing is written to the tree (not even
its root): the engine's pykv stores into a scratch tree of the run's work
directory, and the real tree is only read. The summary says what would be stored.
Only full storage blocks are stored; the tail of a prompt shorter than one block
is not.

The engine takes the same vLLM flags a server does (``pykv.connector.serve``), so
that a warm run and a server given the same flags use the same namespace (engine
block size, dtype, KV cache dtype are part of it). A prompt set of token ids only
needs no tokenizer (the engine starts with ``skip_tokenizer_init``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from pykv.errors import InputError, PykvError

PLAN_KEYS = ("prompt", "prompt_token_ids", "id")


# -- the prompt file (pure: no vLLM) ------------------------------------------------------------
@dataclass(frozen=True)
class WarmPrompt:
    """One line of the prompt file."""

    line: int
    id: str | None = None
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"line": self.line, "id": self.id}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["prompt_token_ids"] = list(self.token_ids or ())
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WarmPrompt":
        ids = data.get("prompt_token_ids")
        return cls(data["line"], data.get("id"), data.get("prompt"), tuple(ids) if ids is not None else None)


def parse_prompt_line(text: str, line: int) -> WarmPrompt:
    """One JSON object: ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}``, optional ``"id"``.
    Other keys are ignored. Raises ``ValueError`` with the reason."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    has_text, has_ids = "prompt" in data, "prompt_token_ids" in data
    if has_text == has_ids:
        raise ValueError('expected exactly one of "prompt" and "prompt_token_ids"')
    ident = data.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        raise ValueError(f'"id" must be a string or an integer, got {json.dumps(ident)}')
    if has_text:
        prompt = data["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError('"prompt" must be a non-empty string')
        return WarmPrompt(line, None if ident is None else str(ident), prompt=prompt)
    ids = data["prompt_token_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError('"prompt_token_ids" must be a non-empty list of token ids')
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f'"prompt_token_ids"[{position}] is not a token id: {json.dumps(token)}')
    return WarmPrompt(line, None if ident is None else str(ident), token_ids=tuple(ids))


def read_prompts(path: str | os.PathLike[str], *, skip_bad: bool = False) -> tuple[list[WarmPrompt], list[str]]:
    """The prompts of a JSON-lines file, and the bad lines skipped (``file:line: reason``).

    Blank lines are ignored. A bad line raises ``InputError("file:line: reason")`` unless
    ``skip_bad``; a missing, unreadable or empty file always raises.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a JSON-lines file of prompts") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    prompts, bad = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append(parse_prompt_line(line, number))
        except ValueError as exc:
            message = f"{path}:{number}: {exc}"
            if not skip_bad:
                raise InputError(message) from None
            bad.append(message)
    if not prompts and not bad:
        raise InputError(f"{path}: no prompts (the file is empty); expected one JSON object per line, "
                         'e.g. {"prompt": "..."} or {"prompt_token_ids": [1, 2, 3]}')
    if not prompts:
        raise InputError(f"{path}: no valid prompt ({len(bad)} bad lines skipped; first: {bad[0]})")
    return prompts, bad


# -- the summary --------------------------------------------------------------------------------
@dataclass
class WarmSummary:
    """What a warm run did (or, with ``dry_run``, would do), in storage blocks ("chunks")."""

    prompts: int = 0
    prompts_run: int = 0  # prefilled (dry run: would be)
    prompts_present: int = 0  # every full block already stored: skipped
    prompts_below_breakeven: int = 0  # shorter than the disk tier's break-even length: skipped
    prompts_too_short: int = 0  # shorter than one storage block: nothing to store
    bad_lines: int = 0  # skipped with --skip-bad
    chunks: int = 0  # full storage blocks in all prompts (shared prefixes count once)
    chunks_stored: int = 0  # newly stored (dry run: would be)
    chunks_present: int = 0  # already in the tree
    chunks_below_breakeven: int = 0
    chunks_missing: int = 0  # should have been stored but are not on disk (store failures)
    tokens_per_chunk: int = 0
    breakeven_tokens: float | None = None  # the shortest disk load the gate admits (with breakeven_margin)
    dry_run: bool = False
    seconds: float = 0.0
    bad: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- the engine side (needs vLLM) ---------------------------------------------------------------
class ChunkKeys:
    """Storage-block keys of token sequences, computed as vLLM's connector computes them."""

    def __init__(self, manager: Any, vllm_config: Any) -> None:
        from pykv.connector import compat
        self.manager = manager
        cache = manager.config.cache
        self.tokens_per_hash = cache.tokens_per_hash
        self.blocks_per_chunk = cache.blocks_per_chunk
        self.tokens_per_chunk = manager.config.groups[0].tokens_per_block * cache.blocks_per_chunk
        self.hashes_per_chunk = self.tokens_per_chunk // self.tokens_per_hash
        self.group_ids = compat.group_ids(manager.config)
        self._hash_chain = compat.prompt_block_hasher(vllm_config)
        self._make_key = compat.make_offload_key

    def __call__(self, token_ids: Sequence[int]) -> list[bytes]:
        hashes = self._hash_chain(token_ids, self.tokens_per_hash)
        ends = hashes[self.hashes_per_chunk - 1::self.hashes_per_chunk]
        return [self._make_key(h, g) for h in ends for g in self.group_ids]


def engine_manager(llm: Any) -> Any:
    """pykv's scheduler-side manager inside an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from pykv.connector import compat
    from pykv.connector.manager import PykvManager
    manager = compat.scheduler_offloading_manager(llm)
    if not isinstance(manager, PykvManager):
        raise RuntimeError("the engine has no pykv manager in this process; run it with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 and pykv's kv_transfer_config")
    return manager


Progress = Callable[[str, int, int], None]


def warm(llm: Any, prompts: Sequence[WarmPrompt], *, dry_run: bool = False, batch: int = 16,
         settle_timeout: float = 300.0, progress: Progress | None = None, tree: Any = None) -> WarmSummary:
    """Store the KV of ``prompts`` through ``llm`` (an in-process engine with pykv); see the module doc.

    ``tree``: the tree to check for present blocks (default: the engine's own; a dry run
    passes the real tree, read only, or None when it does not exist)."""
    from pykv.connector.compat import SamplingParams
    started = time.monotonic()
    report = progress or (lambda phase, done, total: None)
    manager = engine_manager(llm)
    keys_of = ChunkKeys(manager, llm.llm_engine.vllm_config)
    tokenizer = None
    gate = getattr(manager, "gate", None)
    threshold = gate.threshold("disk") if gate is not None else 0
    summary = WarmSummary(prompts=len(prompts), tokens_per_chunk=keys_of.tokens_per_chunk, dry_run=dry_run,
                          breakeven_tokens=None if gate is None else float(threshold))
    if tree is None and not dry_run:
        tree = manager.tree
    present = (lambda key: False) if tree is None else (  # noqa: E731
        lambda key: tree.contains(manager.namespace.id, key))
    seen: set[bytes] = set()
    to_store: set[bytes] = set()
    runs: list[dict[str, Any]] = []
    for done, p in enumerate(prompts, start=1):
        if p.token_ids is not None:
            ids = list(p.token_ids)
        else:
            if tokenizer is None:
                try:
                    tokenizer = llm.get_tokenizer()
                except ValueError:  # skip_tokenizer_init (0.32 raises, older versions return None)
                    tokenizer = None
                if tokenizer is None:
                    raise InputError(f"line {p.line}: a text prompt needs the model's tokenizer, and this "
                                     "engine has none (skip_tokenizer_init); give prompt_token_ids instead")
            ids = tokenizer.encode(p.prompt)  # as vLLM tokenizes a text prompt
        keys = keys_of(ids)
        new_keys = [k for k in dict.fromkeys(keys) if k not in seen]
        seen.update(new_keys)
        missing = [k for k in new_keys if not present(k)]
        summary.chunks += len(new_keys)
        full_tokens = len(ids) // keys_of.tokens_per_chunk * keys_of.tokens_per_chunk
        if not keys:
            summary.prompts_too_short += 1
        elif full_tokens < threshold:
            summary.prompts_below_breakeven += 1
            summary.chunks_below_breakeven += len(missing)
            summary.chunks_present += len(new_keys) - len(missing)
        elif all(present(k) for k in keys):  # nothing new to store
            summary.prompts_present += 1
            summary.chunks_present += len(new_keys)
        else:
            summary.chunks_present += len(new_keys) - len(missing)
            to_store.update(missing)
            runs.append({"prompt_token_ids": ids})
        report("plan", done, len(prompts))
    summary.prompts_run = len(runs)
    summary.chunks_stored = len(to_store)
    if dry_run or not runs:
        summary.seconds = round(time.monotonic() - started, 3)
        return summary
    params = SamplingParams(max_tokens=1, temperature=0)
    for first in range(0, len(runs), batch):
        llm.generate(runs[first:first + batch], params, use_tqdm=False)
        report("prefill", min(first + batch, len(runs)), len(runs))
    _settle(llm, lambda: sum(1 for k in to_store if not present(k)), settle_timeout,
            lambda left: report("store", len(to_store) - left, len(to_store)))
    summary.chunks_missing = sum(1 for k in to_store if not present(k))
    summary.chunks_stored -= summary.chunks_missing
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _settle(llm: Any, missing: Callable[[], int], timeout: float, report: Callable[[int], None]) -> None:
    """Step the in-process engine until the stores are published (vLLM issues a finished
    request's stores in later steps) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    left = missing()
    while left and time.monotonic() < deadline:
        llm.llm_engine.step()
        now = missing()
        if now != left:
            report(now)
        left = now
        if left:
            time.sleep(0.01)
    report(left)


# -- running it: a fresh process per run (vLLM's engine wants its own ``__main__``) -------------------
@dataclass
class WarmPlan:
    """Everything one warm run needs; travels to the engine process as JSON."""

    model: str
    root: str
    prompts: list[WarmPrompt]
    settings: dict[str, Any] = field(default_factory=dict)  # pykv keys (docs/configuration.md)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vllm.LLM keyword arguments
    vllm_args: list[str] = field(default_factory=list)  # vLLM command-line flags, as `pykv serve` takes them
    block_tokens: int = 256
    dry_run: bool = False
    batch: int = 16

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "prompts": [p.to_json() for p in self.prompts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WarmPlan":
        return cls(**{**data, "prompts": [WarmPrompt.from_json(p) for p in data["prompts"]]})


def run_warm(plan: WarmPlan, *, progress: Progress | None = None, python: str = sys.executable,
             failed_log: Path = Path("pykv-warm-engine.log")) -> dict[str, Any]:
    """Run ``plan`` in an engine process of its own; return the summary (``WarmSummary.to_json``).

    The process runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``PYTHONHASHSEED`` (0 when
    unset, as ``pykv serve``). ``progress(phase, done, total)`` is polled from its progress file.
    A user error the engine side finds raises ``InputError``; a failed engine ``PykvError``
    naming its log, kept at ``failed_log``. The run's work directory is removed either way.
    """
    from pykv.connector.serve import engine_env
    with tempfile.TemporaryDirectory(prefix="pykv-warm-") as directory:
        work = Path(directory)
        (work / "plan.json").write_text(json.dumps(plan.to_json()))
        # TMPDIR: what vLLM leaves in the temp directory (vllm_dist_* files) goes with the work directory
        env = {**engine_env()[0], "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TMPDIR": str(work)}
        result, progress_file, log = work / "result.json", work / "progress.json", work / "engine.log"
        with open(log, "w") as log_file:  # a file, not a pipe: engine helper processes may outlive the engine
            proc = subprocess.Popen([python, "-m", "pykv.connector.warm", str(work / "plan.json"), str(result),
                                     str(progress_file)], env=env, stdout=log_file, stderr=subprocess.STDOUT)
            last = None
            while proc.poll() is None:
                time.sleep(0.2)
                try:
                    state = json.loads(progress_file.read_text())
                except (OSError, ValueError):
                    continue
                if progress is not None and state != last:
                    last = state
                    progress(state["phase"], state["done"], state["total"])
        if proc.returncode != 0 or not result.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            shutil.copyfile(log, failed_log)
            raise PykvError(f"the warm engine failed (exit {proc.returncode}): {tail[0]}; full log: "
                            f"{failed_log.resolve()}")
        data = json.loads(result.read_text())
    if "error" in data:
        raise InputError(data["error"])
    return data


def run_plan(plan: WarmPlan, progress_path: Path | None, work: Path) -> dict[str, Any]:
    """(In the engine process) start the engine the plan describes and warm its prompts
    (``work``: the run's own directory, for a dry run's scratch tree)."""
    from pykv.connector.compat import LLM
    from pykv.config import PykvConfig
    from pykv.connector.serve import engine_kwargs, with_platform_defaults
    from pykv.tree import MARKER_NAME, KVTree

    def progress(phase: str, done: int, total: int) -> None:
        if progress_path is not None:
            temp = progress_path.with_name(progress_path.name + ".tmp")
            temp.write_text(json.dumps({"phase": phase, "done": done, "total": total}))
            os.replace(temp, progress_path)

    progress("engine", 0, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the manager must live in this process
    engine_root, tree = plan.root, None
    if plan.dry_run:  # the engine's pykv writes a scratch tree; the real one is only read
        engine_root = str(work / "scratch-tree")
        if (Path(plan.root) / MARKER_NAME).exists():
            tree = KVTree.open(plan.root)
    config = PykvConfig.from_extra_config({"root": engine_root, **plan.settings})
    kwargs = {**engine_kwargs(plan.model, with_platform_defaults(plan.vllm_args)), **plan.engine_args}
    if all(p.token_ids is not None for p in plan.prompts):
        kwargs.setdefault("skip_tokenizer_init", True)  # token ids only: no tokenizer needed
    llm = LLM(model=plan.model, **kwargs, kv_transfer_config=config.to_kv_transfer_config(plan.block_tokens))
    summary = warm(llm, plan.prompts, dry_run=plan.dry_run, batch=plan.batch, progress=progress, tree=tree)
    return summary.to_json()


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pykv warm's engine process (run by `pykv warm`).")
    parser.add_argument("plan", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("progress", type=Path, nargs="?")
    args = parser.parse_args(list(argv) if argv is not None else None)
    plan = WarmPlan.from_json(json.loads(args.plan.read_text()))
    try:
        result = run_plan(plan, args.progress, args.plan.resolve().parent)
    except PykvError as exc:  # the user's mistake, found once the engine is up: one line for the CLI
        result = {"error": str(exc)}
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the slow teardown of the engine's threads
