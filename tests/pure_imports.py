"""Shared by the pure-ledger tests: a module imports neither vLLM nor torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def assert_imports_neither_vllm_nor_torch(*modules: str) -> None:
    code = (f"import sys\nfor m in {list(modules)!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"{modules} pulled in {out.stdout.strip()}"
