"""The scaling-law records of the linear-attention toy: verdicts, fits, and the compute frontier.

Owns the names of the laws (``LAWS``), the per-law record (``LawResult`` with one ``Exponent``
per fitted law), the three-way verdict of a fitted exponent against this model's own predicted
value (``judge_exponent``, within +-``EXPONENT_HALF_WIDTH``, in the project's words
``peakprobe.vocab.CONSISTENT`` etc.), the power-law fit wrapper (``fit_exponent``:
``peakprobe.fits.fit_power_law``, 90% bootstrap interval), the compute frontier over model size
and steps (``compute_frontier``), applied alike to the simulated and to the reduced loss curves,
and the three laws read off the size sweep (``time_law``, ``model_law``, ``compute_law``;
``comparison`` is a ``sweep.LinearAttentionComparison``). The data and context experiments are
``data`` and ``context``; derivations in docs/linear_attention.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from peakprobe.vocab import CI_LEVEL, CONSISTENT, INCONCLUSIVE, INCONSISTENT

__all__ = [
    "EXPONENT_HALF_WIDTH",
    "LAWS",
    "Exponent",
    "Frontier",
    "LawResult",
    "compute_frontier",
    "compute_law",
    "fit_exponent",
    "format_exponent",
    "frontier_exponents",
    "judge_exponent",
    "model_law",
    "time_law",
]

#: the scaling laws the toy reproduces, in the order they are run and printed
LAWS = ("time", "model", "data", "compute", "context")
#: half-width of the interval around each law's predicted exponent that the verdict accepts
EXPONENT_HALF_WIDTH = 0.03
N_BOOT = 1000
TITLES = {"time": "time", "model": "model size", "data": "data size", "compute": "compute",
          "context": "context length"}


def judge_exponent(fitted: float, lo: float, hi: float, predicted: float,
                   half_width: float = EXPONENT_HALF_WIDTH) -> str:
    """Three-way verdict of a fitted exponent with interval [lo, hi] against ``predicted``.

    ``inconsistent`` when the fitted value itself lies more than ``half_width`` from the
    prediction; ``consistent`` when the whole interval lies within predicted +- half_width;
    ``inconclusive`` otherwise (an interval that crosses an edge) or without a finite interval. Unlike the
    1/3 verdict (``peakprobe.fits.judge_third``) the interval need not contain the predicted
    value: the prediction is asymptotic, and the finite ranges simulated here shift the exponent
    by up to ~0.01 (the reduced dynamics show how much), more than the tightest intervals.
    """
    values = (fitted, lo, hi, predicted)
    if any(v is None or not math.isfinite(v) for v in values) or lo > hi:
        return INCONCLUSIVE
    if abs(fitted - predicted) > half_width:
        return INCONSISTENT
    if predicted - half_width <= lo and hi <= predicted + half_width:
        return CONSISTENT
    return INCONCLUSIVE


@dataclass
class Exponent:
    """One fitted exponent: simulation (with its 90% bootstrap interval), the same fit on the
    reduced dynamics, this model's predicted value, and the verdict."""

    name: str  # key, e.g. "model_size"
    law: str  # what is fitted, e.g. "L - L_inf ~ M^-alpha"
    fitted: float
    lo: float
    hi: float
    reduced: float
    predicted: float
    verdict: str = INCONCLUSIVE
    half_width: float = EXPONENT_HALF_WIDTH

    def __post_init__(self) -> None:
        self.verdict = judge_exponent(self.fitted, self.lo, self.hi, self.predicted, self.half_width)


@dataclass
class LawResult:
    """One law: its exponents, the figure it wrote, run time and what the summary keeps."""

    law: str  # one of LAWS
    title: str  # e.g. "model size"
    exponents: list[Exponent]
    figure: str = ""
    wall_s: float = 0.0
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verdict"] = self.verdict
        return out

    @property
    def verdict(self) -> str:
        """``inconsistent`` if any exponent is, ``consistent`` if all are, else ``inconclusive``."""
        verdicts = [e.verdict for e in self.exponents]
        if INCONSISTENT in verdicts:
            return INCONSISTENT
        if verdicts and all(v == CONSISTENT for v in verdicts):
            return CONSISTENT
        return INCONCLUSIVE


def fit_exponent(x: np.ndarray, y: np.ndarray, *, decay: bool = True, n_boot: int = N_BOOT,
                 seed: int = 0) -> tuple[float, float, float, float]:
    """Fit y = c x^(-alpha) (``decay``) or c x^alpha with ``peakprobe.fits.fit_power_law``:
    returns (alpha, lo, hi, c), the interval the project's 90% bootstrap one; NaNs when fewer
    than 4 usable points."""
    from peakprobe.fits import FitError, fit_power_law

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    try:
        fit = fit_power_law(x[keep], y[keep], n_boot=n_boot, ci=CI_LEVEL, seed=seed)
    except FitError:
        nan = float("nan")
        return nan, nan, nan, nan
    if decay:
        return -float(fit.alpha), -float(fit.alpha_hi), -float(fit.alpha_lo), float(fit.c)
    return float(fit.alpha), float(fit.alpha_lo), float(fit.alpha_hi), float(fit.c)


def format_exponent(e: Exponent) -> str:
    """``0.497 [0.48, 0.51] (90% CI), reduced dynamics 0.495; predicted 0.500 -> consistent
    (within +-0.03)``."""
    return (f"{e.fitted:.3f} [{e.lo:.3f}, {e.hi:.3f}] (90% CI), reduced dynamics {e.reduced:.3f}; "
            f"predicted {e.predicted:.3f} -> {e.verdict} (within +-{e.half_width:g})")


@dataclass
class Frontier:
    """The compute frontier min_M L(M, C/M) over a log grid of compute C = M * steps."""

    compute: np.ndarray  # (G,) grid of C
    loss: np.ndarray  # (G,) frontier of the reducible loss (NaN where no size is defined)
    best: np.ndarray  # (G,) index of the best size (-1 where undefined)
    crossings: np.ndarray  # (n_sizes - 1,) C at which size i+1 overtakes size i (NaN if never)
    mid_sizes: np.ndarray  # (n_sizes - 1,) geometric mean of sizes i and i+1


def compute_frontier(sizes: tuple[int, ...], t: np.ndarray, reducible: np.ndarray,
                     n_grid: int = 400) -> Frontier:
    """Frontier of ``reducible`` (n_sizes, P) loss curves at steps ``t`` (P,) over C = M t.

    Each curve is interpolated linearly in log-log space over the steps where it is defined
    (finite and positive). The crossing of neighbours i, i+1 is the C after which the larger
    size stays better (interpolated between grid points): in the scaling limit
    L = M^-a Phi(C / M^(2+a)) it sits at C ~ (M_i M_i+1)^((2+a)/2), so log(mid size) against
    log(crossing) has slope 1/(2+a).
    """
    sizes_arr = np.asarray(sizes, dtype=np.float64)
    logs = []
    lo_c, hi_c = np.inf, 0.0
    for i, m in enumerate(sizes_arr):
        ok = np.isfinite(reducible[i]) & (reducible[i] > 0) & (t > 0)
        logs.append((np.log(m * t[ok]), np.log(reducible[i][ok])))
        if ok.sum() >= 2:
            lo_c, hi_c = min(lo_c, m * t[ok][0]), max(hi_c, m * t[ok][-1])
    grid = np.geomspace(lo_c, hi_c, n_grid)
    lg = np.log(grid)
    curves = np.full((len(sizes_arr), n_grid), np.nan)  # (n_sizes, G) log reducible loss
    for i, (x, y) in enumerate(logs):
        if len(x) >= 2:
            inside = (lg >= x[0]) & (lg <= x[-1])
            curves[i, inside] = np.interp(lg[inside], x, y)
    filled = np.where(np.isfinite(curves), curves, np.inf)
    best = np.argmin(filled, axis=0)
    defined = np.isfinite(filled.min(axis=0))
    loss = np.where(defined, np.exp(np.where(defined, filled.min(axis=0), 0.0)), np.nan)
    crossings = np.full(len(sizes_arr) - 1, np.nan)
    for i in range(len(sizes_arr) - 1):
        d = curves[i] - curves[i + 1]  # > 0: the larger size is better
        both = np.flatnonzero(np.isfinite(d))
        if len(both) < 2 or d[both[-1]] <= 0:
            continue
        below = both[d[both] <= 0]
        if len(below) == 0:
            continue
        j = below[-1]  # last grid point where the smaller size is still as good
        if j + 1 >= n_grid or not np.isfinite(d[j + 1]):
            continue
        frac = d[j] / (d[j] - d[j + 1])  # linear in log C between j and j+1
        crossings[i] = float(np.exp(lg[j] + frac * (lg[j + 1] - lg[j])))
    mid = np.sqrt(sizes_arr[:-1] * sizes_arr[1:])
    return Frontier(grid, loss, np.where(defined, best, -1), crossings, mid)


def frontier_exponents(front: Frontier, n_points: int = 24, *, n_boot: int = N_BOOT,
                       seed: int = 0) -> dict:
    """Exponents of the frontier loss (fitted at ``n_points`` log-spaced C between the first and
    the last crossing, where the optimum is an interior size) and of the optimal size (mid
    sizes against crossings)."""
    ok = np.isfinite(front.crossings)
    nan = float("nan")
    out = dict(loss=(nan, nan, nan, nan), size=(nan, nan, nan, nan), c_lo=nan, c_hi=nan)
    if ok.sum() < 2:
        return out
    c_lo, c_hi = float(front.crossings[ok].min()), float(front.crossings[ok].max())
    pts = np.geomspace(c_lo, c_hi, n_points)
    loss = np.exp(np.interp(np.log(pts), np.log(front.compute), np.log(front.loss)))
    out.update(c_lo=c_lo, c_hi=c_hi, c_points=pts, loss_points=loss,
               loss=fit_exponent(pts, loss, n_boot=n_boot, seed=seed),
               size=fit_exponent(front.crossings[ok], front.mid_sizes[ok], decay=False,
                                 n_boot=n_boot, seed=seed))
    return out


def time_law(comparison: Any) -> LawResult:
    """Time exponent of the largest size with a fit window, against a/(1+a)."""
    t = comparison.summary["time"]
    if t is None:
        nan = float("nan")
        exp = Exponent("time", "L - 1/(N+2) ~ t^-alpha", nan, nan, nan, nan,
                       comparison.summary["theory"]["time"])
    else:
        exp = Exponent("time", f"L - 1/(N+2) ~ t^-alpha (M = {t['model_size']})", t["alpha_sim"],
                       t["alpha_sim_lo"], t["alpha_sim_hi"], t["alpha_reduced"], t["alpha_theory"])
    return LawResult("time", TITLES["time"], [exp], "linear_attention_curves.png")


def model_law(comparison: Any) -> LawResult:
    """Final loss above the floor against model size, against a."""
    s = comparison.summary["size"]
    nan = float("nan")
    exp = Exponent("model_size", "L - L_inf ~ M^-alpha", s.get("alpha_sim", nan),
                   s.get("alpha_sim_lo", nan), s.get("alpha_sim_hi", nan),
                   s.get("alpha_reduced", nan), s["alpha_theory"])
    details = {"alpha_converged_closed_form": s.get("alpha_converged", nan),
               "model_sizes": list(comparison.simulation.model_sizes),
               "final_reducible_sim": comparison.table["final_reducible_sim"].tolist(),
               "final_reducible_reduced": comparison.table["final_reducible_reduced"].tolist()}
    return LawResult("model", TITLES["model"], [exp], "linear_attention_sizes.png", details=details)


def compute_law(comparison: Any, *, n_boot: int = N_BOOT,
                seed: int = 0) -> tuple[LawResult, dict]:
    """Compute frontier over the size sweep (C = M x steps) for the simulation and the reduced
    dynamics: loss exponent a/(2+a) and compute-optimal size exponent 1/(2+a)."""
    sim = comparison.simulation
    floor = comparison.summary["context_floor"]
    theory = comparison.summary["theory"]
    sim_red = sim.loss.mean(axis=1) - floor  # (sizes, P)
    red_red = comparison.reduced_binned - floor
    fronts = {name: compute_frontier(sim.model_sizes, sim.t, curves)
              for name, curves in (("sim", sim_red), ("reduced", red_red))}
    fits = {name: frontier_exponents(f, n_boot=n_boot, seed=seed) for name, f in fronts.items()}
    s, r = fits["sim"], fits["reduced"]
    exps = [Exponent("compute", "frontier L - 1/(N+2) ~ C^-alpha", *s["loss"][:3], r["loss"][0],
                     theory["compute"]),
            Exponent("compute_size", "M_opt ~ C^alpha", *s["size"][:3], r["size"][0],
                     theory["compute_size"])]
    details = {"crossings_sim": fronts["sim"].crossings.tolist(),
               "crossings_reduced": fronts["reduced"].crossings.tolist(),
               "mid_sizes": fronts["sim"].mid_sizes.tolist(),
               "fit_range_compute": [s["c_lo"], s["c_hi"]],
               "compute_unit": "model size M x SGD steps (batch fixed)"}
    plot_data = {"fronts": fronts, "fits": fits, "curves_sim": sim_red, "curves_reduced": red_red}
    return LawResult("compute", TITLES["compute"], exps, "linear_attention_compute.png",
                     details=details), plot_data
