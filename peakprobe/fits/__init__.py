"""Power-law fits with bootstrap intervals, the 1/3 tests and bottleneck classification.

numpy, scipy and pandas only (never torch). Modules: `growth` (m = c t^alpha), `loss`
(L = L0 + c t^-alpha), `classify` (site classes, verdict), `run` (a whole run directory ->
fits.parquet + fits.json), `summary` (terminal text), `synthetic` (planted test runs),
`common` (Huber loss, bootstrap, flags).
"""

from .classify import GROWTH_FLOOR, PEAKED_FRACTION
from .common import FitError
from .growth import GrowthFit, fit_power_law, fit_power_law_many
from .loss import LossFit, fit_loss_law
from .run import FITS_SCHEMA, GROWTH_METRICS, RunFits, fit_run
from .summary import format_summary
from .synthetic import SyntheticRun, make_synthetic_run

__all__ = [
    "FITS_SCHEMA",
    "GROWTH_FLOOR",
    "GROWTH_METRICS",
    "PEAKED_FRACTION",
    "FitError",
    "GrowthFit",
    "LossFit",
    "RunFits",
    "SyntheticRun",
    "fit_loss_law",
    "fit_power_law",
    "fit_power_law_many",
    "fit_run",
    "format_summary",
    "make_synthetic_run",
]
