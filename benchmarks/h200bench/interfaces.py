"""pykv's own interfaces that stages S1-S3 measure, kept thin in one place: ``pykv config`` over
several roots (the configuration measured), ``pykv bench`` over several paths, and the calibration
job over several roots.

``pykv config --root A --root B ...`` is run as the command (``python -m pykv.commands``) when its
dependencies (typer, rich) are on the host; otherwise the same JSON comes from the library calls
the command makes (``PykvConfig.from_extra_config(...).to_kv_transfer_config(256)``), and the
record says which (``source``) and whether both agreed where both ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pykv.config import PykvConfig, root_keys

from h200bench.settings import CHUNK
from h200bench.util import log


def set_items(runner) -> list[str]:
    """The keys S1-S4 add to pykv's defaults: ``--io-engine`` when not ``auto``, then the
    ``--pykv-set KEY=VALUE`` items (a later item wins)."""
    items = [] if runner.a.io_engine == "auto" else [f"io_engine={runner.a.io_engine}"]
    return items + list(runner.a.pykv_set or [])


def library_ktc(roots: list[str], items: list[str], dram_zero: bool = False) -> dict:
    """What ``pykv config --root R ... [--dram 0] [--set K=V ...]`` prints, from the library."""
    extra = root_keys(roots)
    for item in items:
        key, _, value = item.partition("=")
        extra[key.strip()] = value.strip()
    if dram_zero:
        extra["dram_bytes"] = 0
    return PykvConfig.from_extra_config(extra).to_kv_transfer_config(CHUNK)


def command_ktc(runner, roots: list[str], items: list[str], dram_zero: bool = False) -> tuple[dict | None, str]:
    """(the JSON ``pykv config`` printed, or None; the error line when it did not run)."""
    argv = [sys.executable, "-m", "pykv.commands", "config"] + [x for r in roots for x in ("--root", r)]
    argv += [x for item in items for x in ("--set", item)] + (["--dram", "0"] if dram_zero else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=runner.env(), cwd=runner.work)
    except subprocess.TimeoutExpired:
        return None, "pykv config: timed out"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, lines[-1][:300] if lines else f"rc {done.returncode}"
    try:
        return json.loads(done.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"pykv config printed no JSON: {done.stdout[-200:]!r}"


def config_roots(ktc: dict) -> list[str]:
    """The device directories a ``kv_transfer_config`` names (``roots``, or ``root`` alone)."""
    extra = ktc.get("kv_connector_extra_config", {})
    return list(extra.get("roots") or ([extra["root"]] if extra.get("root") else []))


def pykv_config(runner, roots: list[str], *, medium: str) -> dict:
    """The ``kv_transfer_config`` of ``pykv config`` over ``roots``, with the DRAM tier off (``--dram 0``
    only when the defaults would give one); recorded as a ``pykv_config`` record."""
    items = set_items(runner)
    library = library_ktc(roots, items)
    dram_zero = bool(library["kv_connector_extra_config"].get("dram_bytes"))
    if dram_zero:
        library = library_ktc(roots, items, dram_zero=True)
    if runner.dry:
        print(f"  pykv config --root {' --root '.join(roots)}" + "".join(f" --set {i}" for i in items)
              + (" --dram 0" if dram_zero else ""))
        return library
    printed, error = command_ktc(runner, roots, items, dram_zero)
    if printed is not None and config_roots(printed) != list(roots):
        error = f"pykv config printed roots {config_roots(printed)}, not the {len(roots)} asked for (one --root only?)"
        printed = None
    ktc = printed if printed is not None else library
    rec = {"kind": "pykv_config", "stage": runner.stage, "medium": medium, "roots": roots, "set": items,
           "dram_zero_added": dram_zero, "source": "command" if printed is not None else "library", "ktc": ktc}
    if printed is not None:
        rec["same_as_library"] = printed == library
        if printed != library:
            log(f"pykv config printed another config than the library gives: {json.dumps(library)}")
    else:
        rec["command_error"] = error
        log(f"pykv config (command) not used ({error}); using the library's identical call")
    runner.record(rec)
    return ktc


def pykv_bench(runner, directories: list[str], *, medium: str) -> None:
    """``pykv bench --path A --path B ... --json`` (aggregate and per device), when the command runs
    here; one ``pykv_bench`` record with its JSON or the error line."""
    argv = [sys.executable, "-m", "pykv.commands", "bench"] + [x for d in directories for x in ("--path", d)]
    argv += ["--depth", "16", "--block-size", "4M", "--size", "64M" if runner.smoke else "1G", "--no-files", "--no-fio",
             "--json"]
    if runner.dry:
        print("  " + " ".join(argv[2:]))
        return
    for d in directories:
        Path(d).mkdir(parents=True, exist_ok=True)
    rec: dict = {"kind": "pykv_bench", "stage": runner.stage, "medium": medium, "argv": argv[3:]}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=min(150, max(30, runner.remaining() - 300)),
                              env=runner.env(), cwd=runner.work)
        if done.returncode == 0:
            rec["data"] = json.loads(done.stdout)
            if len(directories) > 1 and not isinstance(rec["data"].get("paths", rec["data"].get("path")), list):
                rec["note"] = "the command measured one path (it takes a single --path here)"
        else:
            lines = (done.stderr or done.stdout).strip().splitlines()
            rec["error"] = lines[-1][:300] if lines else f"rc {done.returncode}"
    except (subprocess.TimeoutExpired, ValueError) as exc:
        rec["error"] = repr(exc)[:300]
    if "error" in rec:
        log(f"pykv bench over {len(directories)} paths: {rec['error']}")
    runner.record(rec)


def calibration_over(CalibrationRun, roots: list[Path], **kwargs):
    """A ``CalibrationRun`` over several roots, as ``pykv calibrate --root A --root B ...`` builds it."""
    return CalibrationRun(root=roots[0], roots=list(roots), **kwargs)
