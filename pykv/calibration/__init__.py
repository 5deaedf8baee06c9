"""Break-even calibration: the calibration file, the fit, and the ``BreakEvenGate``.

A load from pykv is not automatically a win: below some prefix length, vLLM
recomputes the prefix faster than pykv can read it and copy it to the GPU. That
length depends on the model, GPU, medium and tier, so it is measured offline
once per (node, model) by ``pykv calibrate`` (``pykv.jobs.calibrate`` runs the
engines) and kept in a small JSON file. At serving time the manager holds a
``BreakEvenGate`` built from that file and refuses loads whose reusable prefix is
shorter than the threshold of the tier that would serve them; vLLM then
recomputes. Nothing is measured or fitted while serving.

The fit: for each measured prefix length L the gain is
``recompute_s(L) - hit_s(L)`` (medians over repetitions; positive = loading wins).
Between measured points the gain is taken as piecewise linear. The break-even
length is the zero crossing of the last segment where the gain goes from
negative to non-negative, i.e. the smallest length from which loading won at
every measured length above it (a noisy early win followed by a loss does not
count). Loading won everywhere: 0 (admit all). Loading lost at the longest
measured length: no threshold (``null`` in the file, refuse every load of that
tier) - nothing was measured that says a longer prefix would win.

The package is pure: it imports neither vLLM nor typer (matplotlib only inside
``save_plot``). ``fit`` holds the fit, ``file`` the calibration file, ``gate`` the
``BreakEvenGate``, ``plot`` the picture; every public name is importable from here.
"""

from pykv.calibration.file import IDENTITY_FIELDS, SCHEMA_KEY, SCHEMA_VERSION, Calibration, CalibrationError
from pykv.calibration.fit import (TIERS, Point, TierCalibration, break_even_tokens, fit_tiers, median,
                                  parse_lengths, parse_tiers)
from pykv.calibration.gate import BreakEvenGate, GateDecision, TierOf, most_reusable, reusable_prefix
from pykv.calibration.plot import save_plot

__all__ = ["IDENTITY_FIELDS", "SCHEMA_KEY", "SCHEMA_VERSION", "TIERS", "BreakEvenGate", "Calibration",
           "CalibrationError", "GateDecision", "Point", "TierCalibration", "TierOf", "break_even_tokens",
           "fit_tiers", "median", "most_reusable", "parse_lengths", "parse_tiers", "reusable_prefix", "save_plot"]
