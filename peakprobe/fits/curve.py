"""The 1/3 test on an external loss curve: time axis, window, loss-law fit, verdict, window scan.

For each model of a :class:`~peakprobe.fits.curve_io.Curve`:

* time: a ``tau`` column when every row has one; else tau from a schedule (``schedule``, or
  the Pythia schedule of ``family`` or of the model's own name, e.g. ``pythia-160m``); else
  the step (flag ``tau_unknown``). ``lr_max`` (for the tau·lr_max axis) comes from that schedule.
* window: steps in [t_min_step, t_max_step] with t > 0; by default from step 512 (the 1/3-law
  authors' Pythia window; they start 70M at 256).
* fit: :func:`~peakprobe.fits.loss.fit_loss_law` (L0 in [0, min L over the window]: the final
  loss on a monotone curve, tighter on one that rises again; its flags ``non_monotone`` /
  ``late_rise``), judged against 1/3 by :func:`~peakprobe.fits.third.judge_third`. A curve
  that ends above its window minimum by more than RISE_NOISE_UNITS residual standard
  deviations around the fitted law is flagged ``ends_above_min`` (``min_step``, ``rise``).
* window scan: the same fit with the window start moved later through up to SCAN_STARTS
  checkpoints (each window keeps at least SCAN_MIN_POINTS checkpoints and 1.5 decades of t:
  over shorter ranges L0 and alpha trade off and the intervals under-cover); a start whose 90%
  interval does not overlap the full window's is a drift (flag ``window_drift``).

Beside it, ``authors_fit`` repeats the 1/3-law authors' own procedure literally: scipy's
``curve_fit`` of log L = log(c t^-alpha + L0) with L0 in [0, final loss], alpha +- one standard
error from the covariance (no bootstrap, no Huber loss).

A model whose fit fails (too few points in the window) is listed in ``failed`` with its one-line
reason; the others are still fitted. numpy / pandas only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.optimize import OptimizeWarning, curve_fit

from peakprobe.checkpoints_index import pythia_schedule
from peakprobe.checkpoints_index.families import pythia_parameters, pythia_size

from ..config import check_band
from ..vocab import BAND
from .common import FitError
from .curve_io import Curve, CurveError
from .loss import ALPHA_MAX, LossFit, fit_loss_law
from .third import judge_third

DEFAULT_T_MIN_STEP = 512
SCAN_STARTS = 8
SCAN_MIN_POINTS = 10
RISE_NOISE_UNITS = 3.0
SCAN_MIN_SPAN = 30.0  # the last t over the first in each scanned window (1.5 decades)
SCAN_COLUMNS = ["model", "t_min_step", "t_min", "n_points", "alpha", "alpha_lo", "alpha_hi",
                "verdict", "drift"]


@dataclass
class CurveFit:
    """One model's curve, its window, loss-law fit, three-way verdict and window scan."""

    model: str
    time_axis: str  # "tau" or "step"
    lr_max: float | None
    n_params: float | None
    n_params_from: str  # "given", "file", "pythia table" or ""
    steps: np.ndarray  # (T,) every step with t > 0
    t: np.ndarray  # (T,)
    loss: np.ndarray  # (T,)
    in_window: np.ndarray  # (T,) bool
    fit: LossFit
    verdict: str
    scan: pd.DataFrame  # SCAN_COLUMNS
    flags: list[str] = field(default_factory=list)
    authors: tuple[float, float, float] = (np.nan, np.nan, np.nan)  # alpha, its s.e., L0
    min_step: int = -1  # the window's lowest loss is at this step
    rise: float = 0.0  # log(final loss / lowest loss) over the window


@dataclass
class CurveResult:
    """All models of one external curve file."""

    curve: Curve
    fits: list[CurveFit]
    failed: dict[str, str]
    band: tuple[float, float]
    t_min_step: float
    t_max_step: float | None


def _schedule_for(model: str, family: str | None, schedule):
    if schedule is not None:
        return schedule
    name = family or model
    size = pythia_size(name)
    if size is None:
        if family is not None:
            raise CurveError(f"unknown family {family!r}: --family knows pythia-<size>; give "
                             "any other schedule as --schedule schedule.json")
        return None
    return pythia_schedule(size)


def ends_above_min(t: np.ndarray, y: np.ndarray, fit: LossFit) -> tuple[int, float, bool]:
    """(index of the window's lowest loss, log(final / lowest), flagged): flagged when that
    rise exceeds RISE_NOISE_UNITS robust standard deviations (1.4826 MAD) of the log residuals
    around the fitted law. (Measured against the law rather than from second differences,
    which a steep early drop inflates.)"""
    resid = np.log(y) - np.log(fit.L0 + fit.c * t**-fit.alpha)
    scale = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    i = int(np.argmin(y))
    rise = float(np.log(y[-1] / y[i]))
    return i, rise, bool(i < len(y) - 1 and rise > RISE_NOISE_UNITS * max(scale, 1e-12))


def authors_fit(t: np.ndarray, y: np.ndarray, start: tuple[float, float, float]
                ) -> tuple[float, float, float]:
    """(alpha, standard error, L0) of ``curve_fit`` on log L = log(c t^-alpha + L0), L0 in
    [0, y[-1]] (the final loss), started from ``start`` = (c, alpha, L0); NaNs if it fails."""
    def model(tt, log_c, alpha, l0):
        return np.log(np.exp(log_c) * tt**-alpha + l0)

    final = float(y[-1])
    p0 = (math.log(max(start[0], 1e-300)), start[1], min(max(start[2], 0.0), final * (1 - 1e-9)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            popt, pcov = curve_fit(model, t, np.log(y), p0=p0, maxfev=20000,
                                   bounds=([-np.inf, 0.0, 0.0], [np.inf, ALPHA_MAX, final]))
    except (RuntimeError, ValueError):
        return (math.nan, math.nan, math.nan)
    se = float(np.sqrt(pcov[1, 1])) if np.isfinite(pcov[1, 1]) else math.nan
    return (float(popt[1]), se, float(popt[2]))


def window_scan(model: str, t: np.ndarray, y: np.ndarray, steps: np.ndarray,
                interval: tuple[float, float], *, n_boot: int = 1000, seed: int = 0,
                band: tuple[float, float] = BAND) -> pd.DataFrame:
    """The loss law refitted from later and later window starts (t, y, steps: the window,
    sorted by time); ``drift`` marks a start whose 90% interval does not overlap ``interval``
    (the full window's): alpha moved by more than both intervals allow."""
    # a planted straight law (24 points, 0.2% noise) drifted in 4 of 20 seeds with a 10-fold
    # minimum range, always at the last start, and in 0 of 20 with 30-fold
    ok = (np.arange(len(t)) <= len(t) - SCAN_MIN_POINTS) & (t[-1] >= SCAN_MIN_SPAN * t)
    last = int(np.flatnonzero(ok)[-1]) if ok.any() else -1
    rows = []
    if last >= 0:
        idx = np.unique(np.round(np.geomspace(1, last + 1, min(SCAN_STARTS, last + 1))).astype(int) - 1)
        for i in idx:
            try:
                f = fit_loss_law(t[i:], y[i:], n_boot=n_boot, seed=seed)
            except FitError:
                continue
            drift = f.alpha_lo > interval[1] or f.alpha_hi < interval[0]
            rows.append({"model": model, "t_min_step": int(steps[i]), "t_min": float(t[i]),
                         "n_points": f.n_points, "alpha": f.alpha, "alpha_lo": f.alpha_lo,
                         "alpha_hi": f.alpha_hi, "verdict": judge_third(f.alpha_lo, f.alpha_hi, band),
                         "drift": bool(drift)})
    return pd.DataFrame(rows, columns=SCAN_COLUMNS)


def _time_axis(tau: np.ndarray, steps: np.ndarray, sched) -> tuple[str, np.ndarray]:
    """("tau", t) from the file's tau column or the schedule, else ("step", steps)."""
    if np.isfinite(tau).all():
        return "tau", tau
    if sched is not None:
        return "tau", np.asarray(sched.tau(steps.astype(float)), dtype=float)
    return "step", steps.astype(float)


def _parameter_count(part: pd.DataFrame, model: str, family: str | None,
                     n_params: float | None) -> tuple[float | None, str]:
    """(parameter count, where it came from): given, the file's column, Pythia's table, or unknown."""
    given = part["n_params"].to_numpy(dtype=float)
    given = given[np.isfinite(given) & (given > 0)]
    size = pythia_size(family or model)
    if n_params is not None:
        return float(n_params), "given"
    if len(given):
        return float(given[0]), "file"
    if size:
        return float(pythia_parameters(size)), "pythia table"
    return None, ""


def fit_curve_models(
    curve: Curve,
    *,
    family: str | None = None,
    schedule=None,
    n_params: float | None = None,
    t_min_step: float = DEFAULT_T_MIN_STEP,
    t_max_step: float | None = None,
    band: tuple[float, float] = BAND,
    n_boot: int = 1000,
    seed: int = 0,
    scan: bool = True,
) -> CurveResult:
    """Fit every model of ``curve`` (see the module docstring); ``n_params`` overrides the
    parameter count of every model (otherwise the file's n_params column, Pythia's table for a
    Pythia name, else unknown)."""
    band = check_band(band)
    if t_max_step is not None and t_max_step < t_min_step:
        raise CurveError(f"t_max_step {t_max_step:g} is below t_min_step {t_min_step:g}")
    fits, failed = [], {}
    for model, part in curve.table.groupby("model", sort=False):
        model = str(model)
        steps = part["step"].to_numpy(dtype=np.int64)
        y = part["value"].to_numpy(dtype=float)
        sched = _schedule_for(model, family, schedule)
        lr_max = float(sched.lr_max) if sched is not None else None
        axis, t = _time_axis(part["tau"].to_numpy(dtype=float), steps, sched)
        flags = list(curve.flags) + (["tau_unknown"] if axis == "step" else [])
        keep = t > 0
        steps, t, y = steps[keep], t[keep], y[keep]
        win = steps >= t_min_step
        if t_max_step is not None:
            win &= steps <= t_max_step
        try:
            base = fit_loss_law(t[win], y[win], n_boot=n_boot, seed=seed)
        except FitError as exc:
            failed[model] = f"{model}: {exc} ({int(win.sum())} checkpoints from step {t_min_step:g})"
            continue
        table = (window_scan(model, t[win], y[win], steps[win], (base.alpha_lo, base.alpha_hi),
                             n_boot=n_boot, seed=seed, band=band) if scan
                 else pd.DataFrame(columns=SCAN_COLUMNS))
        if table["drift"].any():
            flags.append("window_drift")
        count, count_from = _parameter_count(part, model, family, n_params)
        authors = authors_fit(t[win], y[win], (base.c, base.alpha, base.L0))
        i_min, rise, risen = ends_above_min(t[win], y[win], base)
        if risen:
            flags.append("ends_above_min")
        fits.append(CurveFit(
            authors=authors, min_step=int(steps[win][i_min]), rise=rise, model=model, time_axis=axis,
            lr_max=lr_max, n_params=count, n_params_from=count_from, steps=steps, t=t, loss=y,
            in_window=win, fit=base, verdict=judge_third(base.alpha_lo, base.alpha_hi, band),
            scan=table, flags=flags + [f for f in base.flags if f not in flags],
        ))
    if not fits:
        raise CurveError("no model could be fitted: " + "; ".join(failed.values()))
    return CurveResult(curve=curve, fits=fits, failed=failed, band=band, t_min_step=t_min_step,
                       t_max_step=t_max_step)


def fits_table(result: CurveResult) -> pd.DataFrame:
    """One row per fitted model: exponent, 90% interval, verdict, L0, window, flags."""
    rows = []
    for f in result.fits:
        lf = f.fit
        rows.append({
            "model": f.model, "n_params": f.n_params, "metric": result.curve.metric,
            "task": result.curve.task or "", "time_axis": f.time_axis, "lr_max": f.lr_max,
            "t_min_step": int(f.steps[f.in_window][0]), "t_max_step": int(f.steps[f.in_window][-1]),
            "n_points": lf.n_points, "alpha": lf.alpha, "alpha_lo": lf.alpha_lo,
            "alpha_hi": lf.alpha_hi, "verdict": f.verdict, "L0": lf.L0, "L0_lo": lf.L0_lo,
            "L0_hi": lf.L0_hi, "c": lf.c, "r2": lf.r2, "monotone": lf.monotone,
            "final_loss": float(f.loss[f.in_window][-1]), "authors_alpha": f.authors[0],
            "authors_alpha_se": f.authors[1], "authors_L0": f.authors[2],
            "min_step": f.min_step, "rise": f.rise, "flags": ";".join(f.flags),
        })
    return pd.DataFrame(rows)


def format_curve_result(result: CurveResult) -> str:
    """Terminal text: one line per model, then failures."""
    c = result.curve
    what = f"{c.metric}" + (f" of task {c.task}" if c.task else "")
    lines = [f"{c.source}: {what}" + (" (perplexity -> loss by log)" if c.kind == "perplexity" else "")]
    for f in result.fits:
        lf = f.fit
        drift = " window_drift" if "window_drift" in f.flags else ""
        shape = ("" if lf.monotone else " non-monotone") + (
            f" ends_above_min(step {f.min_step})" if "ends_above_min" in f.flags else "")
        lines.append(
            f"  {f.model:<22} alpha = {lf.alpha:.3f} [{lf.alpha_lo:.3f}, {lf.alpha_hi:.3f}]  "
            f"{f.verdict:<12} L0 = {lf.L0:.3g}  {lf.n_points} pts ({f.time_axis})  "
            f"curve_fit {f.authors[0]:.3f} ± {f.authors[1]:.3f}{shape}{drift}"
        )
    for msg in result.failed.values():
        lines.append(f"  not fitted: {msg}")
    return "\n".join(lines)
