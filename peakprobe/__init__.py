"""peakprobe: find the softmax that bottlenecks training.

Per-head peakedness and logit-magnitude statistics across a model family's checkpoints, the
t^(1/3) growth-law fits, and a per-head bottleneck report. The functions below mirror the
command line; importing the package loads nothing heavy.
"""

from .api import FitCurveResult, RunResult, compare, demo, fit, fit_curve, index, report, run, sweep
from .version import __version__

__all__ = ["RunResult", "__version__", "demo", "fit", "index", "report", "run", "sweep"]
__all__ += ["FitCurveResult", "compare", "fit_curve"]
