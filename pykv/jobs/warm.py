"""Warm a pykv tree: compute and store the KV of a prompt set so later requests hit.

``pykv warm`` (``pykv.commands.warm``) reads and checks the prompt file itself
(``read_prompts``: no vLLM needed, so a bad line fails at once), then ``run_warm``
runs ``pykv.jobs.warm_engine`` in an engine process of its own (``pykv.jobs.runner``)
with ``PYTHONHASHSEED`` set, since vLLM's engine must start under a ``__main__``
guard (``run_warm`` does that for library users too). ``warm`` needs one vLLM
engine with pykv in-process (so it can ask pykv's manager what is on disk); for
each prompt it:

- computes its storage-block keys the way vLLM does (``offload_keys.PromptOffloadKeys``:
  chained prefix hashes of ``tokens_per_hash`` tokens, the hash of each storage
  block's last engine block);
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

The engine takes the same vLLM flags a server does (``pykv.jobs.serve``), so
that a warm run and a server given the same flags use the same namespace (engine
block size, dtype, KV cache dtype are part of it). A prompt set of token ids only
needs no tokenizer (the engine starts with ``skip_tokenizer_init``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from pykv.errors import InputError
from pykv.jobs.runner import EngineJob, JobFailed

ENGINE_MODULE = "pykv.jobs.warm_engine"
Progress = Callable[[str, int, int], None]

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
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
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
    chunks_unsigned: int = 0  # with a key file: on disk but not signed with it; quarantined and stored again
    tokens_per_chunk: int = 0
    breakeven_tokens: float | None = None  # the shortest disk load the gate admits (with breakeven_margin)
    dry_run: bool = False
    seconds: float = 0.0
    bad: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- running it: a fresh process per run (vLLM's engine wants its own ``__main__``) -------------------
@dataclass
class WarmPlan:
    """Everything one warm run needs; travels to the engine process as JSON."""

    model: str
    root: str  # the tree's directory; with ``roots``, the first of them
    prompts: list[WarmPrompt]
    settings: dict[str, Any] = field(default_factory=dict)  # pykv keys (docs/configuration.md)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vllm.LLM keyword arguments
    vllm_args: list[str] = field(default_factory=list)  # vLLM command-line flags, as `pykv serve` takes them
    block_tokens: int = 256
    dry_run: bool = False
    batch: int = 16
    roots: list[str] = field(default_factory=list)  # a device set: every directory, one per device

    @property
    def root_paths(self) -> list[str]:
        """The directories of the tree's devices (``roots``, or ``root`` alone)."""
        return list(self.roots) or [self.root]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "prompts": [p.to_json() for p in self.prompts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "WarmPlan":
        return cls(**{**data, "prompts": [WarmPrompt.from_json(p) for p in data["prompts"]]})


def run_warm(plan: WarmPlan, *, progress: Progress | None = None, python: str = sys.executable,
             failed_log: Path = Path("pykv-warm-engine.log")) -> dict[str, Any]:
    """Run ``plan`` in an engine process of its own; return the summary (``WarmSummary.to_json``).

    The process runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``PYTHONHASHSEED`` (0 when
    unset, as ``pykv serve``). ``progress(phase, done, total)`` relays its progress events.
    A user error the engine side finds raises ``InputError``; a failed engine ``JobFailed``
    naming its log, kept at ``failed_log``. The run's work directory is removed either way.
    """
    from pykv.jobs.serve import engine_env
    with tempfile.TemporaryDirectory(prefix="pykv-warm-") as directory:
        work = Path(directory)
        # TMPDIR: what vLLM leaves in the temp directory (vllm_dist_* files) goes with the work directory
        env = {**engine_env()[0], "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TMPDIR": str(work)}
        scratch = work / "scratch-tree"  # a dry run's engine stores here (engines never create a root)
        scratch.mkdir()
        job = EngineJob("warm", ENGINE_MODULE, {"plan": plan.to_json(), "scratch_root": str(scratch)},
                        work, env=env, python=python)
        try:
            return job.run(progress)
        except JobFailed as failed:
            shutil.copyfile(failed.log, failed_log)
            raise JobFailed(failed.name, failed.failure, failed.exit_code, failed_log.resolve(),
                            failed.cause) from None
