"""Run the real ``pykv gc`` CLI in a loop against a tree until a stop file appears.

usage: python gc_loop.py ROOT MAX_SIZE STOP_FILE RESULT.json [INTERVAL_S]

Each run is a fresh ``pykv gc ROOT --max-size MAX_SIZE --min-age 0 --json`` process;
RESULT.json gets the number of runs, every non-zero exit status with its stderr,
and the files freed in total.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

PYKV = [sys.executable, "-c", "from pykv.commands.app import main; main()"]


def main(root: str, max_size: str, stop: str, out: str, interval: float = 0.2) -> None:
    runs, freed, failures, warnings = 0, 0, [], []
    while not Path(stop).exists():
        done = subprocess.run([*PYKV, "gc", root, "--max-size", max_size, "--min-age", "0", "--json"],
                              capture_output=True, text=True)
        runs += 1
        if done.returncode:
            failures.append({"rc": done.returncode, "stderr": done.stderr})
        else:
            freed += json.loads(done.stdout)["freed_files"]
            warnings += [line for line in done.stderr.splitlines() if line.strip()]
        Path(out).write_text(json.dumps({"runs": runs, "freed_files": freed, "failures": failures,
                                         "stderr": warnings[-20:]}))
        time.sleep(interval)


if __name__ == "__main__":
    main(*sys.argv[1:5], *(float(a) for a in sys.argv[5:6]))
