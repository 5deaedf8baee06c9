"""``PykvConfig``: pykv's keys in ``kv_connector_extra_config``, typed and validated.

One dataclass, one table of fields: each field's metadata names its parser and
its one-line meaning, so adding a key is adding one field (the reference table in
docs/configuration.md mirrors ``FIELDS``). vLLM's own keys in the same mapping are
accepted and ignored; any other key, or a value that does not parse, raises
``InputError("kv_connector_extra_config.<key>: ...")`` when the engine starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pykv.errors import InputError
from pykv.tiers import EVICTION_POLICIES
from pykv.config_values import (PREFIX, _bool, _choice, _codec, _codec_chunk, _deadline, _duration, _idle_wait_ms,
                                _int_range, _interval, _margin, _mode, _optional_path, _positive_int, _root, _roots,
                                _segment, _size, _staging, _step_blocks, _switch_ms, _threads_or_auto)

SPEC_NAME = "PykvSpec"
SPEC_MODULE = "pykv.connector.spec"
CONNECTOR_NAME = "PykvOffloadingConnector"
CONNECTOR_MODULE = "pykv.connector.connector"

# Keys vLLM itself (or its OffloadingSpec base) reads from the same mapping.
VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
    "self_describing_kv_events", "canonical_layout", "cache_policy_module_path",
    "prefix_cache_retention_interval", "sync_load_budget_bytes",
})


def root_keys(paths: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """The keys naming a tree's directories: ``root`` for one, ``roots`` (a list) for several."""
    if len(paths) == 1:
        return {"root": os.fspath(paths[0])}
    return {"roots": [os.fspath(path) for path in paths]}


IO_ENGINES = ("auto", "io_uring", "threadpool")
"""``io_engine``'s choices."""
AUTO_MIN_VERIFY_THREADS = 4
"""verify_threads=auto's floor: enough for one device's reads at a few GB/s (xxh3 hashes several GB/s
per thread); above it one thread per device while the host has the cores (docs/configuration.md)."""
DRAM_POLICIES = tuple(EVICTION_POLICIES)
"""``dram_policy``'s choices."""
VERIFY_MODES = ("full", "header")
"""``verify``'s choices: header and payload checksum, or header only."""
CODEC_DECODERS = ("auto", "cpu", "gpu")
def _key(parse: Callable[[Any, str], Any], default: Any, doc: str, type_name: str) -> Any:
    return field(default=default, metadata={"parse": parse, "doc": doc, "type": type_name})


@dataclass(frozen=True)
class PykvConfig:
    """pykv's settings; build with ``PykvConfig.from_extra_config``."""

    root: str = _key(_root, "", "Directory of the pykv tree, an absolute path: it must exist (`pykv init DIR` "
                     "creates one; pykv never does); used if empty or a tree; a directory holding other files is "
                     "refused (make it a tree with `pykv init`). Required.", "path")
    roots: tuple[str, ...] = _key(_roots, (), "Directories of one pykv tree each, one per device (a list of "
                                  "absolute paths): each block lives on one of them, one of three chosen from its "
                                  "key (rendezvous hashing; the one recent stores used least). "
                                  "Every directory must exist, as `root`; give `root` or `roots`.", "paths")
    staging_bytes: int | None = _key(_staging, "auto", "Transient staging memory per worker (slots for disk "
                                     "I/O). auto: two slots per read in flight on every device (2 x io_depth x "
                                     "devices) plus preload_max_bytes when preload is on, at most a quarter of "
                                     "the host's memory.", "size")
    io_depth: int = _key(_positive_int(4096), 16, "Disk reads and writes in flight per worker and device.", "int")
    open_ahead: int = _key(_positive_int(65536), 32, "Files opened ahead of their reads, per device.", "int")
    read_segment_bytes: int = _key(_segment, 0, "Split each block file's read into parallel reads of this "
                                   "size (multiple of 4 KiB); 0 reads a block in one request. Media that "
                                   "read faster with more, smaller requests in flight gain (see "
                                   "docs/benchmarks.md).", "size")
    io_engine: str = _key(_choice(*IO_ENGINES), "auto",
                          "I/O backend. auto: io_uring when usable and the medium takes O_DIRECT (one device "
                          "or several), else the preadv/pwritev thread pool.", "str")
    dram_bytes: int = _key(_size, 0, "DRAM tier size per worker; 0 disables the tier.", "size")
    dram_policy: str = _key(_choice(*DRAM_POLICIES), "lru", "DRAM tier replacement policy.", "str")
    preload: bool = _key(_bool, False, "Read the stored blocks of requests still waiting in vLLM's queue into "
                         "staging slots ahead of their scheduling (off by default: stock vLLM already loads a "
                         "request's KV in the background once it is admitted).", "bool")
    preload_look_ahead: int = _key(_positive_int(65536), 8, "Waiting requests (oldest first) whose blocks are "
                                   "preloaded at a time.", "int")
    preload_max_bytes: int = _key(_size, "256M", "Staging memory per worker that preloaded blocks not yet "
                                  "claimed by their request may hold.", "size")
    store: bool = _key(_bool, True, "Store new KV in the tree. false: this instance only loads what others "
                       "stored (a read-only mount, a tree filled by `pykv warm`).", "bool")
    fsync: bool = _key(_bool, False, "fsync each block file (and its directory) before publishing.", "bool")
    verify: str = _key(_choice(*VERIFY_MODES), "full",
                       "Checks on load: header and payload checksum, or header only.", "str")
    verify_threads: int | None = _key(_threads_or_auto, "auto", "Threads that check payload checksums (verify=full) "
                                      "or MACs (auth_key_file) beside the reads, and seal stores (checksum, MAC). "
                                      "auto: max(4, min(devices, half the host's cores)).",
                                      "int")
    codec: str = _key(_codec, "none", "How block payloads are stored: none (as they are), planes-zstd (lossless, "
                      "bit-exact, about 0.68 of the bytes for CPU time to encode and decode) or fp8 (lossy, opt-in: "
                      "0.51 of the bytes, coded on the GPU, bf16/fp16 KV only) or fp8-zstd (fp8's KV in about 0.42 of the "
                      "bytes: fp8's bytes zstd-coded on the codec threads, decoded by nvCOMP or the codec threads). Each codec "
                      "is a namespace of its own. See docs/codecs.md.", "str")
    codec_threads: int | None = _key(_threads_or_auto, "auto", "Threads that encode stores and decode loads "
                                     "with planes-zstd, and fp8-zstd's zstd layer (one scratch block each, plus 2; fp8 runs on the GPU). auto: "
                                     "half the host's cores, 2 to 8.", "int")
    codec_chunk: int | None = _key(_codec_chunk, "auto", "Bytes per zstd chunk of planes-zstd and fp8-zstd (a "
                                   "multiple of 4 KiB, 16 KiB to 64 MiB; each chunk's planes are frames of their own, "
                                   "and nvCOMP decodes a step's frames in parallel); part of the codec's parameters, "
                                   "so of the namespace. auto: 1 MiB (planes-zstd), 256 KiB (fp8-zstd).", "size")
    codec_decode: str = _key(_choice(*CODEC_DECODERS), "auto", "Where planes-zstd loads (fp8-zstd's frames) are decoded: "
                             "cpu (the codec threads; fp8-zstd: its zstd layer there, fp8 on the GPU), gpu (nvCOMP on the KV's GPU; the engine "
                             "refuses to start without it) or auto (gpu where nvCOMP is installed and passes its start "
                             "check, else cpu; nvCOMP 6.0 needs verify=full or auth_key_file there, and auth_key_file "
                             "for its fast modes).", "str")
    codec_step_blocks: int | None = _key(_step_blocks, "auto", "Loads of one length a device codec's step "
                                         "(fp8, fp8-zstd, planes-zstd on the GPU) takes at most: one copy, one decode "
                                         "and one scatter for them all; its scratch on the KV's GPU holds that many "
                                         "blocks. auto: as many as a bounded scratch holds (payload: fp8 256 MiB, "
                                         "fp8-zstd 192 MiB, planes-zstd 128 MiB), 1 to 16.", "int")
    codec_graphs: bool = _key(_bool, False, "Replay fp8's load steps of whole blocks as CUDA graphs: a step is "
                              "then a few calls instead of some forty, each of which waits for the GIL beside the "
                              "engine's loop (docs/configuration.md, \"The GIL\"); false: kernel by kernel.", "bool")
    gil_switch_ms: float | None = _key(_switch_ms, "keep", "The engine process's GIL switch interval in "
                                      "milliseconds (sys.setswitchinterval), set when the worker starts; keep: "
                                      "leave it (Python's default is 5). pykv's threads issue many short GIL-"
                                      "releasing calls; beside the engine's busy loop each can wait a whole "
                                      "interval for the GIL (docs/configuration.md, \"The GIL\").", "float")
    idle_wait_ms: float = _key(_idle_wait_ms, 10.0, "On an engine step that runs no model while this worker's "
                               "loads run, wait up to this long for one to end before vLLM's loop goes round "
                               "again, leaving the GIL to pykv's threads (docs/configuration.md, \"The GIL\"); "
                               "0: never wait.", "float")
    store_retry_interval: float = _key(_duration, "60s", "After a store fails at the disk (full, read-only), "
                                       "stores pause this long; one warning per pause.", "duration")
    lookup_deadline: float = _key(_deadline, "1s", "The scheduler waits at most this long for a device to answer a "
                                  "request's existence checks: an unanswered block is a miss (recomputed), and a "
                                  "device with a check running longer answers miss at once until it returns (a "
                                  "stalled mount never blocks the engine's step longer).", "duration")
    io_deadline: float = _key(_deadline, "30s", "A load or store job whose blocks make no progress this long is "
                              "given up: a load's blocks not yet copied are recomputed, a store ends for vLLM "
                              "unstored once no copy reads its GPU blocks (its writes finish or fail later, never "
                              "torn). Also bounds how long shutdown waits for I/O in flight.", "duration")
    max_tree_bytes: int = _key(_size, 0, "Keep the tree under this size while serving (per device with `roots`): "
                               "a background thread evicts least-recently-used blocks down to 90 % of it, one "
                               "engine at a time; 0: no limit.", "size")
    evict_interval: float = _key(_interval, "10s", "With max_tree_bytes: how often the tree's size is checked (also "
                                 "after this engine stored 5 % of the limit).", "duration")
    evict_min_age: float = _key(_duration, "60s", "With max_tree_bytes: blocks published more recently are never "
                                "evicted.", "duration")
    file_mode: int = _key(_mode, "0600", "Permission bits of block files.", "octal")
    dir_mode: int = _key(_mode, "0700", "Permission bits of directories pykv creates.", "octal")
    auth_key_file: str | None = _key(_optional_path, None, "Key file of authenticated blocks (KEY_ID HEX lines, "
                                     "the first key signs, all verify; mode 0600): every block stored is signed, "
                                     "every load needs a valid MAC (else a miss, quarantined). See "
                                     "docs/format.md.", "path")
    mac_threads: int = _key(_int_range(0, 64), 0, "Threads that hash one block's MAC (auth_key_file); "
                            "0: BLAKE3's pool over all cores.", "int")
    breakeven_file: str | None = _key(_optional_path, None, "Calibration file of `pykv calibrate`: loads shorter "
                                      "than their tier's break-even length are refused (recomputed).", "path")
    breakeven_override: bool = _key(_bool, False, "Use breakeven_file even if its model, dtype or KV layout "
                                    "differ from the engine's.", "bool")
    breakeven_margin: float = _key(_margin, 0.05, "Refuse loads up to this fraction above the break-even length "
                                   "too: near the crossing a load gains nothing on average and carries the "
                                   "medium's spread.", "float")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # normalise defaults given in their written form
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, f.metadata["parse"](value, f.name) if f.name != "root" else value)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "PykvConfig":
        """Parse pykv's keys from ``kv_connector_extra_config``; raise ``InputError`` naming the key."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key in VLLM_KEYS:
                continue
            if key not in known:
                raise InputError(f"{PREFIX}.{key}: unknown key (pykv keys: {', '.join(sorted(known))})")
            values[key] = known[key].metadata["parse"](value, key)
        if "root" in values and "roots" in values:
            raise InputError(f"{PREFIX}.roots: give root (one device) or roots (several), not both")
        if "root" not in values and "roots" not in values:
            raise InputError(f"{PREFIX}.root: required (the directory of the pykv tree; roots: one per device)")
        return cls(**values)

    @property
    def root_paths(self) -> tuple[str, ...]:
        """The directories of the tree's devices (``roots``, or ``root`` alone)."""
        return self.roots or (self.root,)

    @property
    def root_key(self) -> str:
        """The key the directories came from, to name in messages."""
        return f"{PREFIX}.{'roots' if self.roots else 'root'}"

    def transient_slots(self, slot_bytes: int) -> int:
        """Staging slots for disk I/O of blocks of ``slot_bytes`` (``staging_bytes``, or auto)."""
        if self.staging_bytes is not None:
            return self.staging_bytes // slot_bytes
        wanted = 2 * self.io_depth * len(self.root_paths) + (self.preload_max_bytes // slot_bytes if self.preload else 0)
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(self.io_depth + 1, min(wanted, memory // 4 // slot_bytes))

    def hashing_threads(self) -> int:
        """The verifier threads: ``verify_threads``, or auto (one per device up to half the cores, never under 4)."""
        if self.verify_threads is not None:
            return self.verify_threads
        return max(AUTO_MIN_VERIFY_THREADS, min(len(self.root_paths), (os.cpu_count() or 1) // 2))

    def codec_worker_threads(self) -> int:
        """The codec threads: ``codec_threads``, or auto (half the cores, 2 to 8: on the H200 host 14
        threads decoded slower than 8 beside the engine)."""
        if self.codec_threads is not None:
            return self.codec_threads
        return max(2, min(8, (os.cpu_count() or 4) // 2))

    def to_extra_config(self) -> dict[str, Any]:
        """pykv's keys in their written form (sizes in bytes, modes as octal strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("staging_bytes", "verify_threads", "codec_threads", "codec_chunk", "codec_step_blocks") and value is None:
                value = "auto"
            if f.name == "gil_switch_ms" and value is None:
                value = "keep"
            if value is None or value == () or (f.name == "root" and not value):
                continue  # an unset optional key (breakeven_file), the unused one of root and roots
            if f.metadata["type"] == "octal":
                value = f"{value:04o}"
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_kv_transfer_config(self, model_block_size_tokens: int = 256) -> dict[str, Any]:
        """The dict for ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)``.

        ``model_block_size_tokens`` is the storage block (one file) in tokens; it must be
        a multiple of the engine's ``--block-size``.
        """
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "spec_name": SPEC_NAME,
                "spec_module_path": SPEC_MODULE,
                "block_size": model_block_size_tokens,
                **self.to_extra_config(),
            },
        }


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(PykvConfig)
