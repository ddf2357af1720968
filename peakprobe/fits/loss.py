"""The loss law L(t) = L0 + c * t^(-alpha), fitted in log space, with bootstrap intervals.

Point estimate (Epoch AI practice, docs/science.md): the Huber loss (delta = 1e-3) of
log L - log(L0 + c t^-alpha), summed over checkpoints, is evaluated on a grid of starting points
(alpha x L0, with log c set to its robust best for each pair); the 8 best are refined together
by the batched solver below, the best 2 of those start L-BFGS-B with bounds L0 in [0, min L]
and alpha in [0, 5], and the winner is polished by the batched solver. (Refining first keeps
the L-BFGS-B runs short: each of its iterations can cost milliseconds when OpenBLAS threads
compete for a busy CPU.)

Interval: the smoothed residual bootstrap of `common` on log L; every resample is refitted at
once by a batched Levenberg-Marquardt iteration on the Huber IRLS weights (3x3 normal equations
per resample in closed form, steps accepted only when the Huber loss falls, L0 projected into
[0, min L*] of that resample), starting from the point estimate.

Coverage of the 90% alpha interval, 30 log-spaced points over three decades, L0 = 2 and a
reducible loss of L0 / 4 at the last point: 92% at 2% noise and alpha = 1/3 (1,200
replicates); 88-95% over alpha in {0.2, 1/3, 0.5} and noise 0.5-5% (400 replicates each; most
conservative at alpha = 0.2 with 5% noise, where the bound L0 >= 0 is reached). When the
reducible part is smaller than the noise at the end of the window, alpha is poorly identified
and the interval can under-cover (88% with c = 5, alpha = 0.5, 2% noise).

Internally the curve is L0 + exp(k - alpha * (log t - mean log t)) (better conditioned than c);
c = exp(k + alpha * mean log t). ``loss_block`` lays a fitted law out for fits.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize

from .common import (
    FitError,
    FitOptions,
    bootstrap_draws,
    curve_flags,
    huber,
    percentile_interval,
    resampled_errors,
    shape_flags,
    third_distance,
)
from .third import judge_third

MIN_POINTS = 5  # three parameters need at least five checkpoints
ALPHA_MAX = 5.0
ALPHA_GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0)
L0_GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)  # fractions of min L
N_STARTS = 8  # grid points refined by the batched solver
N_LBFGSB = 2  # refined starts handed to L-BFGS-B
REFINE_ITERS = 100
K_SPAN = 60.0
POLISH_ITERS = 500
BOOT_ITERS = 60


@dataclass(frozen=True)
class LossFit:
    """A fitted L = L0 + c * t^-alpha with bootstrap intervals.

    ``third_in_ci`` / ``third_distance_ci`` are plain facts (is 1/3 inside the interval, how
    far in half-widths), not a verdict: `third.judge_third` gives the three-way verdict."""

    alpha: float
    alpha_lo: float
    alpha_hi: float
    c: float
    L0: float
    L0_lo: float
    L0_hi: float
    r2: float
    n_points: int
    t_min: float
    t_max: float
    monotone: bool
    flags: tuple[str, ...]
    third_in_ci: bool
    third_distance_ci: float


def _model(theta: np.ndarray, xc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """theta (M, 3) = (L0, k, alpha) -> log-loss model f, power term u, loss M = L0 + u;
    each (M, n)."""
    u = np.exp(theta[:, 1:2] - theta[:, 2:3] * xc)
    mval = theta[:, 0:1] + u
    return np.log(mval), u, mval


def _objective(theta: np.ndarray, xc: np.ndarray, y: np.ndarray, delta: float) -> np.ndarray:
    """Summed Huber loss of the log residuals, (M,)."""
    a = np.abs(y - _model(theta, xc)[0])
    c = np.minimum(a, delta)
    return (c * (a - 0.5 * c)).sum(axis=-1)  # c (a - c/2) is the Huber loss with c = min(a, delta)


def _solve3(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Solve symmetric 3x3 systems a (M, 3, 3) x = g (M, 3) by the adjugate (Cramer)."""
    a00, a01, a02 = a[:, 0, 0], a[:, 0, 1], a[:, 0, 2]
    a11, a12, a22 = a[:, 1, 1], a[:, 1, 2], a[:, 2, 2]
    c00 = a11 * a22 - a12 * a12
    c01 = a02 * a12 - a01 * a22
    c02 = a01 * a12 - a02 * a11
    c11 = a00 * a22 - a02 * a02
    c12 = a01 * a02 - a00 * a12
    c22 = a00 * a11 - a01 * a01
    det = a00 * c00 + a01 * c01 + a02 * c02
    det = np.where(np.abs(det) > 0, det, np.inf)  # a singular system takes no step
    x0 = c00 * g[:, 0] + c01 * g[:, 1] + c02 * g[:, 2]
    x1 = c01 * g[:, 0] + c11 * g[:, 1] + c12 * g[:, 2]
    x2 = c02 * g[:, 0] + c12 * g[:, 1] + c22 * g[:, 2]
    return np.stack([x0, x1, x2], axis=1) / det[:, None]


def _clip(theta: np.ndarray, l0_max: np.ndarray, k_range: tuple[float, float]) -> np.ndarray:
    theta[:, 0] = np.clip(theta[:, 0], 0.0, l0_max)
    theta[:, 1] = np.clip(theta[:, 1], *k_range)
    theta[:, 2] = np.clip(theta[:, 2], 0.0, ALPHA_MAX)
    return theta


def _normal_equations(theta: np.ndarray, xc: np.ndarray, y: np.ndarray, delta: float,
                      powers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(J^T W J (M, 3, 3), J^T W r (M, 3)) of the Huber-weighted least squares at ``theta``
    (M, 3); ``powers`` (n, 3): 1, xc, xc^2."""
    f, u, mval = _model(theta, xc)
    r = y - f  # (M, n)
    w = delta / np.maximum(np.abs(r), delta)  # (M, n) Huber IRLS weights
    # d f / d (L0, k, alpha) = (1 / M, u / M, -xc u / M): columns 1 and 2 differ by -xc
    inv = 1.0 / mval
    ju = u * inv
    wi = w * inv
    s_ii = (wi * inv).sum(axis=1)  # sum w / M^2
    s_iu = (wi * ju) @ powers[:, :2]  # (M, 2): sum w u / M^2 (times 1, xc)
    s_uu = (w * ju * ju) @ powers  # (M, 3): sum w u^2 / M^2 (times 1, xc, xc^2)
    wr = w * r
    g_i = (wr * inv).sum(axis=1)
    g_u = (wr * ju) @ powers[:, :2]
    a = np.empty((len(y), 3, 3))
    a[:, 0, 0] = s_ii
    a[:, 0, 1] = a[:, 1, 0] = s_iu[:, 0]
    a[:, 0, 2] = a[:, 2, 0] = -s_iu[:, 1]
    a[:, 1, 1] = s_uu[:, 0]
    a[:, 1, 2] = a[:, 2, 1] = -s_uu[:, 1]
    a[:, 2, 2] = s_uu[:, 2]
    return a, np.stack([g_i, g_u[:, 0], -g_u[:, 1]], axis=1)


def lm_fit(
    xc: np.ndarray,
    y: np.ndarray,
    theta: np.ndarray,
    l0_max: np.ndarray,
    k_range: tuple[float, float],
    delta: float,
    max_iter: int,
    tol: float = 1e-10,
) -> np.ndarray:
    """Batched Huber Levenberg-Marquardt: y (M, n) log losses, theta (M, 3) start -> (M, 3).

    A row stops once its proposed step is below ``tol``; rows still moving are compacted
    every 10 steps.
    """
    theta = theta.astype(np.float64, copy=True)
    out = theta.copy()
    active = np.arange(len(y))
    lam = np.full(len(y), 1e-3)
    fval = _objective(theta, xc, y, delta)
    powers = np.stack([np.ones_like(xc), xc, xc * xc], axis=1)  # (n, 3): sums of v, v xc, v xc^2
    for it in range(max_iter):
        a, g = _normal_equations(theta, xc, y, delta, powers)
        damped = a.copy()
        for i in range(3):
            damped[:, i, i] += lam * a[:, i, i] + 1e-12
        step = _solve3(damped, g)  # (M, 3)
        new = _clip(theta + step, l0_max, k_range)
        fnew = _objective(new, xc, y, delta)
        accept = fnew <= fval
        theta = np.where(accept[:, None], new, theta)
        fval = np.where(accept, fnew, fval)
        lam = np.where(accept, np.maximum(lam / 3.0, 1e-9), np.minimum(lam * 4.0, 1e9))
        moving = np.abs(step).max(axis=1) > tol
        if not moving.any():
            break
        if (it + 1) % 10 == 0 and moving.mean() < 0.7:
            out[active[~moving]] = theta[~moving]
            active, y, theta = active[moving], y[moving], theta[moving]
            lam, fval, l0_max = lam[moving], fval[moving], l0_max[moving]
    out[active] = theta
    return out


def _grid_starts(
    xc: np.ndarray, y: np.ndarray, lmin: float, k_range: tuple[float, float], delta: float
) -> np.ndarray:
    """The N_STARTS best (L0, k, alpha) of the start grid, best first."""
    loss = np.exp(y)
    starts = []
    for frac in L0_GRID:
        l0 = frac * lmin
        gap = np.log(np.maximum(loss - l0, 1e-300))
        for alpha in ALPHA_GRID:
            starts.append((l0, float(np.clip(np.median(gap + alpha * xc), *k_range)), alpha))
    grid = np.array(starts)  # (G, 3)
    vals = _objective(grid, xc, y[None, :], delta)
    return grid[np.argsort(vals, kind="stable")[:N_STARTS]]


def _lbfgsb(
    xc: np.ndarray,
    y: np.ndarray,
    start: np.ndarray,
    lmin: float,
    k_range: tuple[float, float],
    delta: float,
) -> np.ndarray:
    def fun(p: np.ndarray) -> tuple[float, np.ndarray]:
        f, u, mval = (v[0] for v in _model(p[None, :], xc))
        r = y - f
        psi = np.clip(r, -delta, delta)
        jac = np.stack([1.0 / mval, u / mval, -xc * u / mval])  # (3, n)
        # scaled by 1/delta so the objective is O(sum |r|) and the tolerances mean something
        return float(huber(r, delta).sum() / delta), -(jac @ psi) / delta

    bounds = [(0.0, lmin), k_range, (0.0, ALPHA_MAX)]
    res = minimize(fun, start, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 500, "ftol": 1e-12, "gtol": 1e-8})
    return np.asarray(res.x, dtype=np.float64)


def _point_estimate(
    xc: np.ndarray, y: np.ndarray, lmin: float, k_range: tuple[float, float], delta: float
) -> np.ndarray:
    """Grid -> batched refinement of the best starts -> L-BFGS-B from the best two -> polish."""
    starts = _grid_starts(xc, y, lmin, k_range, delta)  # (N_STARTS, 3)
    m = len(starts)
    refined = lm_fit(xc, np.repeat(y[None, :], m, axis=0), starts, np.full(m, lmin), k_range,
                     delta, REFINE_ITERS)
    vals = _objective(refined, xc, np.repeat(y[None, :], m, axis=0), delta)
    candidates = [_lbfgsb(xc, y, refined[i], lmin, k_range, delta)
                  for i in np.argsort(vals, kind="stable")[:N_LBFGSB]]
    cand = np.array(candidates)  # (N_LBFGSB, 3)
    polished = lm_fit(xc, np.repeat(y[None, :], len(cand), axis=0), cand,
                      np.full(len(cand), lmin), k_range, delta, POLISH_ITERS)
    pvals = _objective(polished, xc, np.repeat(y[None, :], len(cand), axis=0), delta)
    return polished[int(np.argmin(pvals))]


def _clean(t: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    t = np.asarray(t, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    if t.ndim != 1 or loss.shape != t.shape:
        raise FitError(
            f"t and L must be 1-D arrays of the same length, got {t.shape} and {loss.shape}"
        )
    ok = np.isfinite(t) & np.isfinite(loss) & (t > 0) & (loss > 0)
    if ok.sum() < MIN_POINTS:
        raise FitError(
            f"the loss-law fit needs at least {MIN_POINTS} checkpoints with t > 0 and a positive "
            f"finite loss, got {int(ok.sum())}; widen the window or add checkpoints"
        )
    order = np.argsort(t[ok], kind="stable")
    tt = t[ok][order]
    if tt[0] == tt[-1]:
        raise FitError("the loss-law fit needs at least two distinct times t")
    return tt, loss[ok][order], bool((~ok).any())


@dataclass(frozen=True)
class LossBoot:
    """Bootstrap refits of the loss law: theta (B, 3) = (L0, k, alpha) with
    L = L0 + exp(k - alpha * (log t - xbar))."""

    theta: np.ndarray
    xbar: float

    def reducible_at(self, t: float) -> np.ndarray:
        """Bootstrap L - L0 at time t: (B,)."""
        return np.exp(self.theta[:, 1] - self.theta[:, 2] * (np.log(t) - self.xbar))


def fit_loss_law(t: np.ndarray, L: np.ndarray, **options: Any) -> LossFit:
    """Fit L = L0 + c * t^-alpha with L0 in [0, min L]; bootstrap ``ci`` intervals for alpha, L0.

    ``options``: those of ``FitOptions`` (n_boot, ci, seed, delta). Points with t <= 0 or a
    non-positive / non-finite loss are dropped (flag ``dropped_points``).
    Raises FitError with fewer than 5 usable points. A curve that rises again late is flagged
    (``non_monotone``, ``late_rise``) and still fitted.
    """
    return fit_loss_law_boot(t, L, **options)[0]


def _bootstrap(xc: np.ndarray, f: np.ndarray, res: np.ndarray, theta: np.ndarray,
               k_range: tuple[float, float], delta: float, n_boot: int, seed: int) -> np.ndarray:
    """(B, 3) refits of the residual bootstrap around the fitted log losses ``f`` (1, n)."""
    n = len(xc)
    idx, z = bootstrap_draws(n, n_boot, seed)
    scaled = res * np.sqrt(n / (n - 3))  # the usual residual rescaling for 3 parameters
    ystar = f + resampled_errors(scaled[None, :], idx, z)[0]  # (B, n)
    l0_max = np.exp(ystar.min(axis=1))
    start = np.repeat(theta[None, :], n_boot, axis=0)
    start[:, 0] = np.minimum(start[:, 0], l0_max)
    return lm_fit(xc, ystar, start, l0_max, k_range, delta, BOOT_ITERS, tol=1e-8)


def fit_loss_law_boot(t: np.ndarray, L: np.ndarray, **options: Any) -> tuple[LossFit, LossBoot | None]:
    """`fit_loss_law` that also returns the bootstrap refits (None when n_boot = 0)."""
    o = FitOptions(**options)
    n_boot, ci, seed, delta = o.n_boot, o.ci, o.seed, o.delta
    tt, loss, dropped = _clean(t, L)
    n = len(tt)
    lt = np.log(tt)
    xbar = lt.mean()
    xc = lt - xbar
    y = np.log(loss)
    lmin = float(loss.min())

    # log c is kept where the power term stays within e^+-K_SPAN of the losses (no underflow)
    k_range = (float(y.min()) - K_SPAN, float(y.max()) + K_SPAN)

    theta = _point_estimate(xc, y, lmin, k_range, delta)

    f = _model(theta[None, :], xc)[0]  # (1, n)
    res = y - f[0]
    boot = _bootstrap(xc, f, res, theta, k_range, delta, n_boot, seed) if n_boot > 0 else None
    if boot is not None:
        a_lo, a_hi = percentile_interval(boot[:, 2], ci)
        l_lo, l_hi = percentile_interval(boot[:, 0], ci)
        loss_boot = LossBoot(theta=boot, xbar=float(xbar))
    else:
        a_lo = a_hi = l_lo = l_hi = np.float64(np.nan)
        loss_boot = None
    ss_res = float((res * res).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    monotone, late = shape_flags(y[None, :], np.array([-1.0]))
    flags = curve_flags(n, bool(monotone[0]), bool(late[0]), rising=False)
    l0, k, alpha = (float(v) for v in theta)
    if l0 <= 1e-9 * lmin or l0 >= lmin * (1.0 - 1e-9):
        flags.append("L0_at_bound")
    if dropped:
        flags.append("dropped_points")
    in_ci, dist = third_distance(alpha, float(a_lo), float(a_hi))
    fit = LossFit(alpha=alpha, alpha_lo=float(a_lo), alpha_hi=float(a_hi), c=float(np.exp(k + alpha * xbar)),
                  L0=l0, L0_lo=float(l_lo), L0_hi=float(l_hi), r2=r2, n_points=n, t_min=float(tt[0]),
                  t_max=float(tt[-1]), monotone=bool(monotone[0]), flags=tuple(flags),
                  third_in_ci=in_ci, third_distance_ci=dist)
    return fit, loss_boot


def _json_float(v: float | None) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def loss_block(loss: LossFit | None, band: tuple[float, float]) -> dict | None:
    """fits.json's ``loss``: the law's numbers, its three-way verdict and flags."""
    if loss is None:
        return None
    return {
        **{k: _json_float(getattr(loss, k)) for k in ("alpha", "alpha_lo", "alpha_hi", "L0",
                                                       "L0_lo", "L0_hi", "c", "t_min", "t_max")},
        "verdict": judge_third(loss.alpha_lo, loss.alpha_hi, band),
        "third_in_ci": bool(loss.third_in_ci), "n_points": int(loss.n_points),
        "flags": list(loss.flags),
    }
