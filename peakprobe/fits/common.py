"""Pieces shared by every fit: the error type, the Huber loss, the smoothed residual bootstrap,
percentile intervals, and the curve-shape flags (monotone, late rise / drop, few points).

The bootstrap is a *smoothed residual* bootstrap: resampled errors are the fit's residuals
drawn with replacement plus Gaussian noise of bandwidth h = 1.4826 * MAD(residuals) * n^(-1/5)
(the 3-parameter loss law also rescales its residuals by sqrt(n / (n - 3))). With the near-L1
Huber loss (delta = 1e-3 on log values) the plain pairs bootstrap over-covers (a 90% interval
held the truth 93.6% of the time over 1,000 replicates of 30 points) and the plain residual
bootstrap under-covers (86.5%): the Huber/LAD line passes almost exactly through two points,
so the empirical residuals understate the errors' spread. Smoothed, the growth interval held
the truth 90.3-91.3% of the time (3 x 1,000 replicates, 30 points, 2% noise; 88-93% for
n = 10..140, noise 0.3-5%, Gaussian or t3 errors). The intervals assume independent errors
around the law: residuals that drift together (a curve that bends) make them too narrow.
The draws (indices and standard normals) depend only on (seed, n_boot, n), so every series
fitted on the same checkpoints shares them and one series gives the same interval whether it
is fitted alone or inside a whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from peakprobe.vocab import PeakprobeError

DELTA = 1e-3  # Huber threshold on log-space residuals (Epoch AI practice)
FEW_POINTS = 8  # fewer points than this: the `few_points` flag
MONOTONE_NOISE_UNITS = 4.0  # a reversal must exceed this many noise standard deviations


class FitError(PeakprobeError):
    """A curve cannot be fitted (too few usable points, bad arguments)."""


@dataclass(frozen=True)
class FitOptions:
    """How a law is fitted: the keyword options every fit function takes, with their defaults."""

    n_boot: int = 1000  # bootstrap refits (0: no interval)
    ci: float = 0.9  # the interval's coverage
    seed: int = 0  # fixes the bootstrap draws
    delta: float = DELTA  # Huber threshold on log residuals

    def __post_init__(self) -> None:
        check_options(self.n_boot, self.ci, self.delta)


def huber(r: np.ndarray, delta: float) -> np.ndarray:
    """Huber loss of residuals: r^2/2 inside [-delta, delta], linear outside."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def check_options(n_boot: int, ci: float, delta: float) -> None:
    if not isinstance(n_boot, (int, np.integer)) or n_boot < 0:
        raise FitError(f"n_boot must be a non-negative integer, got {n_boot!r}")
    if not 0.0 < ci < 1.0:
        raise FitError(f"ci must be strictly between 0 and 1 (e.g. 0.9), got {ci!r}")
    if not delta > 0.0:
        raise FitError(f"delta (the Huber threshold) must be positive, got {delta!r}")


def bootstrap_draws(n: int, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Resampling indices and smoothing normals, both (n_boot, n), fixed by (seed, n_boot, n)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    z = rng.standard_normal((n_boot, n))
    return idx, z


def smoothing_bandwidth(res: np.ndarray) -> np.ndarray:
    """Kernel bandwidth per series: 1.4826 * MAD * n^(-1/5); res is (S, n), returns (S,)."""
    n = res.shape[-1]
    med = np.median(res, axis=-1, keepdims=True)
    mad = np.median(np.abs(res - med), axis=-1)
    return 1.4826 * mad * n ** -0.2


def resampled_errors(res: np.ndarray, idx: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Smoothed bootstrap errors: res (S, n), idx/z (B, n) -> (S, B, n)."""
    h = smoothing_bandwidth(res)  # (S,)
    return res[:, idx] + h[:, None, None] * z[None, :, :]


def percentile_interval(samples: np.ndarray, ci: float) -> tuple[np.ndarray, np.ndarray]:
    """Equal-tailed percentile interval along the last axis (NaN where no samples)."""
    if samples.shape[-1] == 0:
        nan = np.full(samples.shape[:-1], np.nan)
        return nan, nan.copy()
    q = np.quantile(samples, [(1.0 - ci) / 2.0, (1.0 + ci) / 2.0], axis=-1)
    return q[0], q[1]


def _edge_running_median(v: np.ndarray, half: int) -> np.ndarray:
    """Running median along the last axis over [i-half, i+half], shrinking at the ends."""
    if half == 0:
        return v
    pad = np.full(v.shape[:-1] + (half,), np.nan)
    padded = np.concatenate([pad, v, pad], axis=-1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1, axis=-1)
    return np.nanmedian(windows, axis=-1)


def noise_scale(v: np.ndarray) -> np.ndarray:
    """Noise std of each row from second differences (blind to smooth trends); (S, n) -> (S,)."""
    if v.shape[-1] < 4:
        return np.zeros(v.shape[:-1])
    d2 = np.diff(v, n=2, axis=-1)
    med = np.median(d2, axis=-1, keepdims=True)
    return 1.4826 * np.median(np.abs(d2 - med), axis=-1) / np.sqrt(6.0)


def shape_flags(v: np.ndarray, direction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonicity of log-values ``v`` (S, n) along ``direction`` (S,) of +1 (rising) or -1.

    The rows are smoothed with a running median of 5 (3 below 10 points) so a lone outlier is
    not a reversal; a reversal counts when the smoothed curve falls back against its direction by
    more than 4 noise standard deviations (noise from second differences). Returns
    (monotone, late_reversal): late_reversal means the curve ends below its best value by that
    much (a late rise of a falling loss, a late drop of a rising metric).
    """
    n = v.shape[-1]
    half = 0 if n < 5 else (1 if n < 10 else 2)
    s = _edge_running_median(v, half) * direction[:, None]  # (S, n), rising = good
    tol = np.maximum(MONOTONE_NOISE_UNITS * noise_scale(v), 1e-9)  # (S,)
    best = np.maximum.accumulate(s, axis=-1)
    drawdown = (best - s).max(axis=-1)
    late = (best[:, -1] - s[:, -1]) > tol
    return drawdown <= tol, late


def curve_flags(n: int, monotone: bool, late: bool, rising: bool) -> list[str]:
    """The shape flags of one fitted curve, in a fixed order."""
    flags = []
    if n < FEW_POINTS:
        flags.append("few_points")
    if not monotone:
        flags.append("non_monotone")
    if late:
        flags.append("late_drop" if rising else "late_rise")
    return flags


def third_distance(alpha: float, lo: float, hi: float) -> tuple[bool, float]:
    """Is 1/3 inside [lo, hi], and how far is it from alpha in units of the CI half-width
    on 1/3's side (<= 1 exactly when inside)."""
    third = 1.0 / 3.0
    if not np.isfinite(alpha) or not np.isfinite(lo) or not np.isfinite(hi):
        return False, float("nan")
    half = (hi - alpha) if third >= alpha else (alpha - lo)
    gap = abs(third - alpha)
    if half <= 0.0:
        dist = 0.0 if gap == 0.0 else float("inf")
    else:
        dist = gap / half
    return bool(lo - 1e-9 <= third <= hi + 1e-9), float(dist)


def p_at_most(estimate: np.ndarray, samples: np.ndarray, bound: float, *,
              robust: bool = False) -> np.ndarray:
    """One-sided p-value of "the quantity is at most ``bound``" from a point estimate (S,) and
    its bootstrap samples (S, B): the normal tail sf((estimate - bound) / sd) with sd the
    bootstrap standard error, or with ``robust`` the samples' interquartile range / 1.349 (the
    same for normal samples; a ratio's few huge draws do not inflate it). (A count of samples
    below the bound cannot go under 1 / (B + 1), too coarse for Benjamini-Hochberg over hundreds
    of sites.) NaN without samples; a zero sd gives 0 or 1. Small p: the quantity lies above
    the bound."""
    est = np.asarray(estimate, dtype=float)
    if samples.shape[-1] < 2:
        return np.full(est.shape, np.nan)
    if robust:
        q1, q3 = np.nanpercentile(samples, [25.0, 75.0], axis=-1)
        sd = (q3 - q1) / 1.349
    else:
        sd = np.nanstd(samples, axis=-1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (est - bound) / sd
    z = np.where(sd > 0, z, np.where(est > bound, np.inf, -np.inf))
    return np.where(np.isfinite(est), norm.sf(z), np.nan)


def bh_qvalues(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values) of a 1-D array; NaN entries stay NaN
    and do not count as tests. A test is a discovery at false-discovery rate q when its
    q-value is <= q."""
    p = np.asarray(p, dtype=float)
    q = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    if m == 0:
        return q
    order = ok[np.argsort(p[ok], kind="stable")]
    scaled = p[order] * m / np.arange(1, m + 1)
    q[order] = np.minimum(np.minimum.accumulate(scaled[::-1])[::-1], 1.0)
    return q
