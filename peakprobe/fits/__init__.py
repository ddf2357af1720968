"""Power-law fits with bootstrap intervals, the three-way 1/3 verdicts and the bottleneck answer.

numpy, scipy and pandas only (never torch). Modules: `growth` (m = c t^alpha), `loss`
(L = L0 + c t^-alpha), `third` (consistent / inconsistent / inconclusive against 1/3),
`window` (time axis, fit window, excluded duplicates, loss spikes, alpha(t_min) scan),
`classify` (peakedness, site classes, the bottleneck verdict from gains), `run` (a whole run
directory -> fits.parquet + fits.json), `text` (terminal text), `curve` and `curve_io`
(external loss curves: reading them, fitting them), `common` (Huber loss, bootstrap, one-sided
p-values, Benjamini-Hochberg, flags).
"""

from .common import FitError
from .growth import GrowthFit, fit_power_law, fit_power_law_many
from .loss import LossFit, fit_loss_law
from .run import RunFits, fit_run
from .text import format_fits
from .third import judge_third

__all__ = [
    "FitError",
    "GrowthFit",
    "LossFit",
    "RunFits",
    "fit_loss_law",
    "fit_power_law",
    "fit_power_law_many",
    "fit_run",
    "format_fits",
    "judge_third",
]
