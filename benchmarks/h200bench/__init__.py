"""The H200 benchmark of pykv in stock vLLM, as modules with one job each.

``settings`` (constants, model shapes, anchors, host paths), ``util`` (JSON lines,
documents, host probes), ``stats`` (the engines' counter files), ``engine`` (one vLLM
engine process), ``probes`` (O_DIRECT and H2D bandwidth), ``loop`` (loop devices and
/dev/shm), ``runner`` (spawning engines with their settings), ``stages`` (stages A-M),
``calibrate_stage`` (stage K), ``striping`` and ``striping_report`` (stages S1-S3), ``multibw``
(O_DIRECT of several devices at once), ``interfaces`` (pykv's commands S1-S3 measure), ``report``,
``compare`` (two calibration files),
``cli``; the ``preload_*`` modules hold ``h200_preload.py``'s stages, the ``decode_*`` modules
``h200_decode.py``'s stage I. The entry points stay ``benchmarks/h200_connector.py``,
``benchmarks/h200_preload.py`` and ``benchmarks/h200_decode.py`` (method and stages: benchmarks/README.md).

Nothing heavy happens at import: engine processes import these modules too.
"""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path

if _importlib_util.find_spec("pykv") is None:  # a plain checkout: pykv's core from the repository
    _sys.path.append(str(_Path(__file__).resolve().parent.parent.parent))
