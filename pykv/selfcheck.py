"""``python -P -m pykv.selfcheck``: import every module of the installed pykv; exit 1 naming each that fails.

``scripts/install.sh`` runs it after installing (so a wheel missing a module fails the install,
not the user's first command), and ``tests/test_packaging.py`` runs it in a fresh environment
with ``--own-only``: there vLLM and torch are absent, and only a missing pykv module counts.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def failed_imports(*, own_only: bool = False) -> list[str]:
    """``"module: Error: message"`` for each pykv module that does not import (``own_only``: only
    those whose missing module is pykv's own)."""
    import pykv

    failed = []
    for module in pkgutil.walk_packages(pykv.__path__, "pykv."):
        if module.name.endswith("__main__"):
            continue  # runs the CLI
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            if not own_only or (exc.name or "").split(".")[0] == "pykv":
                failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001  (any failure at import is the finding)
            failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pykv.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--own-only", action="store_true",
                        help="count only pykv's own missing modules (an environment without vLLM)")
    args = parser.parse_args(argv)
    failed = failed_imports(own_only=args.own_only)
    import pykv
    print(pykv.__file__)
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
