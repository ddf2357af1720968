"""Growth fits m(t) = c * t^alpha: a Huber line in log-log space with a bootstrap interval.

The line log m = a + alpha * (log t - mean log t) is fitted by iteratively reweighted least
squares (IRLS): each step solves a weighted 2x2 least-squares problem with Huber weights
w = delta / max(|r|, delta), which is the majorize-minimize step for the Huber loss, so the
loss never increases. Steps are over-relaxed (factor up to 1.9, reset to 1 when two successive
slope steps disagree in sign); any factor in (0, 2) keeps the descent property.

Many series on the same checkpoints are fitted together, and all their bootstrap resamples too:
the refits form one (rows, n) array, solved in cache-sized blocks with a few numpy operations
and two small matrix products per step, with no per-resample optimizer. The fit is equivariant
(adding a line to the data adds it to the fit), so each resample fits only its resampled
errors, starting from zero, in float32. The point estimate runs to convergence (float64); the
refits stop after BOOT_ITERS steps at most, which leaves the 5%/95% quantiles within 2.2% of
the interval's width of their converged values at 30 points and 5% noise, the slowest case
measured, and within 0.01% at 142 points (the Monte Carlo error of a 1,000-resample percentile
is about 2% of the width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .common import (
    FitError,
    FitOptions,
    bootstrap_draws,
    curve_flags,
    percentile_interval,
    shape_flags,
    smoothing_bandwidth,
)

MIN_POINTS = 4  # fewer usable points than this is a FitError
FLAT_ALPHA = 0.05  # |alpha| below this: the `flat` flag
POINT_ITERS = 2000
BOOT_ITERS = 60
BLOCK_ELEMS = 1 << 17  # elements per IRLS block (512 KiB of float32): stays in cache


@dataclass(frozen=True)
class GrowthFit:
    """A fitted m(t) = c * t^alpha over [t_min, t_max] with a bootstrap interval for alpha."""

    alpha: float
    alpha_lo: float
    alpha_hi: float
    c: float
    r2: float
    n_points: int
    t_min: float
    t_max: float
    monotone: bool
    flags: tuple[str, ...]


def huber_lines(
    x: np.ndarray,
    y: np.ndarray,
    delta: float,
    *,
    max_iter: int,
    tol: float = 1e-12,
    start: np.ndarray | None = None,
    dtype: type = np.float64,
) -> np.ndarray:
    """Huber fits of y (M, n) on the centred design x (n,); returns (M, 2) = (intercept, slope).

    Starts from ``start`` (M, 2) or from ordinary least squares. A row stops once its slope step
    is below ``tol`` (rows still moving are compacted every 10 steps); all stop after
    ``max_iter`` steps. ``dtype`` float32 halves the memory traffic of bootstrap refits.
    """
    y = np.asarray(y, dtype=dtype)
    x = np.asarray(x, dtype=dtype)
    ones = np.ones_like(x)
    x3 = np.stack([ones, x, x * x], axis=1)  # (n, 3)
    x2 = np.stack([ones, x], axis=1)  # (n, 2)
    x2t = np.ascontiguousarray(x2.T)  # (2, n); a contiguous operand keeps the product fast
    floor = np.full(y.shape, delta, dtype=dtype)  # np.maximum is much faster array-to-array
    if start is None:
        p = _weighted_line(np.broadcast_to(x3.sum(axis=0), (len(y), 3)), y @ x2)
    else:
        p = np.asarray(start, dtype=dtype).copy()
    out = np.empty((len(y), 2))
    active = np.arange(len(y))
    omega = np.ones(len(y), dtype=dtype)
    prev = np.zeros(len(y), dtype=dtype)
    for it in range(max_iter):
        m = len(y)
        r = p @ x2t  # (M, n) fitted values
        np.subtract(y, r, out=r)
        np.abs(r, out=r)
        np.maximum(r, floor[:m], out=r)
        w = np.divide(floor[:m], r)  # (M, n) Huber IRLS weights delta / max(|r|, delta)
        sums = w @ x3  # (M, 3): sum w, sum w x, sum w x^2
        np.multiply(w, y, out=w)
        step = _weighted_line(sums, w @ x2) - p  # (M, 2)
        omega = np.where(step[:, 1] * prev > 0.0, np.minimum(omega * 1.5, 1.9), 1.0)
        omega = omega.astype(dtype, copy=False)
        p += omega[:, None] * step
        prev = step[:, 1]
        moving = np.abs(prev) > tol
        if not moving.any():
            break
        if (it + 1) % 10 == 0 and moving.mean() < 0.7:
            out[active[~moving]] = p[~moving]
            active, y, p = active[moving], y[moving], p[moving]
            omega, prev = omega[moving], prev[moving]
    out[active] = p
    return out


def _weighted_line(sums: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve the 2x2 weighted normal equations: sums (M, 3), rhs (M, 2) -> (M, 2)."""
    s0, s1, s2 = sums[:, 0], sums[:, 1], sums[:, 2]
    det = s0 * s2 - s1 * s1
    slope = (s0 * rhs[:, 1] - s1 * rhs[:, 0]) / det
    icept = (rhs[:, 0] - slope * s1) / s0
    return np.stack([icept, slope], axis=1)


def _bootstrap_lines(
    x: np.ndarray, res: np.ndarray, n_boot: int, seed: int, delta: float
) -> np.ndarray:
    """(intercept, slope) deviations of the smoothed residual bootstrap: res (S, n) ->
    (S, n_boot, 2).

    Refits run in float32 on blocks of ~BLOCK_ELEMS elements taken across series.
    """
    n_series, n = res.shape
    idx, z = bootstrap_draws(n, n_boot, seed)
    z32 = z.astype(np.float32)
    h = smoothing_bandwidth(res).astype(np.float32)  # (S,)
    res32 = res.astype(np.float32)
    rows = max(1, BLOCK_ELEMS // n)
    per_chunk = max(1, 8 * rows // n_boot)  # series per chunk of errors (about 8 blocks)
    out = np.empty((n_series, n_boot, 2))
    for s0 in range(0, n_series, per_chunk):
        sl = slice(s0, min(s0 + per_chunk, n_series))
        errs = res32[sl][:, idx]  # (k, B, n) resampled residuals
        errs += h[sl, None, None] * z32  # smoothing
        errs = errs.reshape(-1, n)  # (k * B, n)
        lines = np.empty((len(errs), 2))
        for b0 in range(0, len(errs), rows):
            block = errs[b0 : b0 + rows]
            lines[b0 : b0 + rows] = huber_lines(
                x, block, delta, max_iter=BOOT_ITERS, tol=1e-7,
                start=np.zeros((len(block), 2)), dtype=np.float32,
            )
        out[sl] = lines.reshape(-1, n_boot, 2)
    return out


@dataclass(frozen=True)
class BootLines:
    """Bootstrap refits of S lines log m = icept + slope * (log t - xbar): (S, B) each."""

    icept: np.ndarray
    slope: np.ndarray
    xbar: float

    def log_value_at(self, t: float) -> np.ndarray:
        """Bootstrap log m at time t: (S, B)."""
        return self.icept + self.slope * (np.log(t) - self.xbar)


def _clean(t: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if t.ndim != 1 or y.shape != t.shape:
        raise FitError(f"t and y must be 1-D arrays of the same length, got {t.shape} and {y.shape}")
    ok = np.isfinite(t) & np.isfinite(y) & (t > 0) & (y > 0)
    if ok.sum() < MIN_POINTS:
        raise FitError(
            f"a power-law fit needs at least {MIN_POINTS} points with t > 0 and a positive "
            f"finite value, got {int(ok.sum())}; widen the window or add checkpoints"
        )
    order = np.argsort(t[ok], kind="stable")
    tt, yy = t[ok][order], y[ok][order]
    if tt[0] == tt[-1]:
        raise FitError("a power-law fit needs at least two distinct times t")
    return tt, yy, bool((~ok).any())


def fit_power_law(t: np.ndarray, y: np.ndarray, **options: Any) -> GrowthFit:
    """Fit y = c * t^alpha (Huber loss on log y against log t) with a ``ci`` bootstrap interval.

    ``options``: those of ``FitOptions`` (n_boot, ci, seed, delta). Points with t <= 0 or a
    non-positive / non-finite y are dropped (flag ``dropped_points``).
    Raises FitError with fewer than 4 usable points.
    """
    FitOptions(**options)  # checks them before the series
    tt, yy, dropped = _clean(t, y)
    fit = fit_power_law_many(tt, yy[None, :], **options)[0]
    if dropped:
        return GrowthFit(**{**fit.__dict__, "flags": (*fit.flags, "dropped_points")})
    return fit


def fit_power_law_many(t: np.ndarray, y: np.ndarray, **options: Any) -> list[GrowthFit]:
    """Fit every row of y (S, n) against the shared, increasing, positive times t (n,).

    All values must be finite and positive (fit_power_law cleans a single series first).
    Row s gets the fit fit_power_law(t, y[s]) gives (equal to the solver tolerance).
    ``options``: those of ``FitOptions``.
    """
    return fit_power_law_boot(t, y, **options)[0]


def fit_power_law_boot(
    t: np.ndarray, y: np.ndarray, **options: Any
) -> tuple[list[GrowthFit], BootLines | None]:
    """`fit_power_law_many` that also returns the bootstrap refits (None when n_boot = 0),
    for one-sided tests and derived intervals (gain shares, "still growing")."""
    o = FitOptions(**options)
    n_boot, ci, seed, delta = o.n_boot, o.ci, o.seed, o.delta
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = t.shape[0]
    if n < MIN_POINTS:
        raise FitError(f"a power-law fit needs at least {MIN_POINTS} points, got {n}")
    if not (np.all(np.isfinite(y)) and np.all(y > 0) and np.all(t > 0)):
        raise FitError("fit_power_law_many needs finite, positive t and y; clean the series first")
    if np.any(np.diff(t) < 0) or t[0] == t[-1]:
        raise FitError("fit_power_law_many needs increasing times t with at least two distinct values")
    lt = np.log(t)
    xbar = lt.mean()
    x = lt - xbar  # (n,) centred log time
    ly = np.log(y)  # (S, n)
    p = huber_lines(x, ly, delta, max_iter=POINT_ITERS)  # (S, 2)
    fitted = p @ np.stack([np.ones_like(x), x])  # (S, n)
    res = ly - fitted
    ss_res = (res * res).sum(axis=1)
    ss_tot = ((ly - ly.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    r2 = np.where(ss_tot > 0, 1.0 - ss_res / np.where(ss_tot > 0, ss_tot, 1.0), 1.0)
    boot = None
    if n_boot > 0:
        dev = _bootstrap_lines(x, res, n_boot, seed, delta)  # (S, B, 2)
        boot = BootLines(icept=p[:, 0:1] + dev[..., 0], slope=p[:, 1:2] + dev[..., 1], xbar=xbar)
        lo, hi = percentile_interval(boot.slope, ci)
    else:
        lo = hi = np.full(len(p), np.nan)
    rising = p[:, 1] >= 0
    monotone, late = shape_flags(ly, np.where(rising, 1.0, -1.0))
    out = []
    for s in range(len(p)):
        alpha = float(p[s, 1])
        flags = curve_flags(n, bool(monotone[s]), bool(late[s]), bool(rising[s]))
        if abs(alpha) < FLAT_ALPHA:
            flags.append("flat")
        out.append(
            GrowthFit(
                alpha=alpha,
                alpha_lo=float(lo[s]),
                alpha_hi=float(hi[s]),
                c=float(np.exp(p[s, 0] - alpha * xbar)),
                r2=float(r2[s]),
                n_points=n,
                t_min=float(t[0]),
                t_max=float(t[-1]),
                monotone=bool(monotone[s]),
                flags=tuple(flags),
            )
        )
    return out, boot
