"""peakprobe: find the softmax that bottlenecks training.

Per-head peakedness and logit-magnitude statistics across a model family's checkpoints, the
t^(1/3) growth-law fits, and a per-head bottleneck report. The functions below mirror the
command line (``peakprobe.api``); their settings are the records of ``peakprobe.config``.
Importing the package loads nothing heavy.
"""

from .api import (
    FitCurveResult,
    RunResult,
    ToyResult,
    compare,
    demo,
    fit,
    fit_curve,
    index,
    planted,
    probe,
    report,
    run,
    sweep,
    toy_linear,
    toy_peaked,
)
from .version import __version__

__all__ = [
    "FitCurveResult",
    "RunResult",
    "ToyResult",
    "__version__",
    "compare",
    "demo",
    "fit",
    "fit_curve",
    "index",
    "planted",
    "probe",
    "report",
    "run",
    "sweep",
    "toy_linear",
    "toy_peaked",
]
