"""Fitting a whole run directory: `fit_run` reads the sweep's results, fits every site's growth
and the loss law, classifies the sites, and writes `fits.parquet` and `fits.json`.

Time axis: ``auto`` is tau when every checkpoint has a finite tau, else step.

Window (the checkpoints fitted): t > 0 and step >= the start step, where the start step is the
manifest's ``schedule.warmup_steps`` when the manifest has one, else 1% of the largest step
(Pythia: warmup is 1% of training). ``t_min`` replaces that start rule (t >= t_min, t > 0);
``t_max`` adds t <= t_max. Both are in units of the chosen time axis.

Growth fits (m = c t^alpha) are made for GROWTH_METRICS: the logit magnitudes the 1/3 law is
about (logit_std, logit_max_minus_mean, logit_top_gap; target_logit_minus_mean for the LM head)
and, as descriptive effective exponents, max_prob and entropy (negative alpha when falling).
Bounded or signed metrics (peaked, entropy_norm, first_key_prob, target_prob, sensitivity) are
not fitted. Checkpoints where a metric is missing or not positive are left out of that
series' fit (flag ``dropped_points``); a series with fewer than 4 usable points gets a row of
NaNs flagged ``no_fit``. The loss law is fitted to the LM head's `loss`.

The site classes use a late fit of logit_std: the same power law refitted on the second half of
the window in log time (at least 6 checkpoints); see `classify`. `peaked` and `sensitivity`
are read at the window's last checkpoint (the run's last one unless t_max cuts it);
first_value / final_value are the run's first and last checkpoints. The `sensitivity` column
repeats the site's value on each of its rows (the loss row carries the LM head's).

All bootstrap draws depend only on (seed, n_boot, number of points), so the same results give
the same bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from peakprobe import results
from peakprobe.results import FITS_SCHEMA

from . import classify
from .common import FEW_POINTS, FitError
from .growth import MIN_POINTS, fit_power_law_many
from .loss import LossFit, fit_loss_law

GROWTH_METRICS = (
    "logit_std",
    "logit_max_minus_mean",
    "logit_top_gap",
    "target_logit_minus_mean",
    "max_prob",
    "entropy",
)
WARMUP_FRACTION = 0.01
LATE_MIN_POINTS = 6
SERIES_PER_BATCH = 64
KEYS = ["site_kind", "layer", "head", "metric"]



@dataclass
class RunFits:
    """Everything `fit_run` found: the fits.parquet table, per-site classes, the loss fit and
    the fits.json verdicts."""

    run_dir: Path
    model: str
    time_axis: str
    t_min: float
    t_max: float
    n_points: int
    table: pd.DataFrame  # fits.parquet, one row per fit
    sites: pd.DataFrame  # one row per site: class, late alpha, sensitivity
    loss: LossFit | None
    verdict: dict  # fits.json


def _checkpoints(df: pd.DataFrame) -> pd.DataFrame:
    ck = df.groupby("step", sort=True).agg(tau=("tau", "first"), revision=("revision", "first"))
    return ck.reset_index()


def _time_axis(ck: pd.DataFrame, time_axis: str) -> str:
    if time_axis not in ("auto", "tau", "step"):
        raise FitError(f"time_axis must be 'auto', 'tau' or 'step', got {time_axis!r}")
    tau_known = bool(np.all(np.isfinite(ck["tau"].to_numpy(dtype=float))))
    if time_axis == "tau" and not tau_known:
        raise FitError(
            "time_axis='tau' needs a finite tau for every checkpoint (the schedule is unknown "
            "for some); use time_axis='step' or give the run a schedule"
        )
    if time_axis == "auto":
        return "tau" if tau_known else "step"
    return time_axis


def _window(ck: pd.DataFrame, t: np.ndarray, manifest: dict,
            t_min: float | None, t_max: float | None) -> np.ndarray:
    steps = ck["step"].to_numpy()
    keep = t > 0
    if t_min is None:
        warmup = (manifest.get("schedule") or {}).get("warmup_steps")
        start = float(warmup) if warmup is not None else WARMUP_FRACTION * float(steps.max())
        keep &= (steps >= start) & (steps > 0)
    else:
        keep &= t >= t_min
    if t_max is not None:
        keep &= t <= t_max
    if keep.sum() < MIN_POINTS:
        raise FitError(
            f"only {int(keep.sum())} checkpoints fall in the fit window (need at least "
            f"{MIN_POINTS}); sweep more checkpoints or widen the window with t_min / t_max"
        )
    return keep


def _late(t: np.ndarray) -> np.ndarray:
    """Mask of the late half (in log time) of the window times t (n,), at least 6 points."""
    late = t >= math.sqrt(t[0] * t[-1])
    if late.sum() < LATE_MIN_POINTS:
        late = np.zeros(len(t), dtype=bool)
        late[-min(LATE_MIN_POINTS, len(t)):] = True
    return late


def _fit_series(t: np.ndarray, y: np.ndarray, n_boot: int, seed: int,
                progress: bool, desc: str) -> list[dict]:
    """Growth fits of rows y (S, n) on times t (n,); NaN / non-positive points are dropped.

    Rows sharing the same usable points are fitted together."""
    usable = np.isfinite(y) & (y > 0)  # (S, n)
    out: list[dict] = [{} for _ in range(len(y))]
    patterns: dict[bytes, list[int]] = {}
    for s in range(len(y)):
        patterns.setdefault(usable[s].tobytes(), []).append(s)
    jobs = []
    for rows in patterns.values():
        for b0 in range(0, len(rows), SERIES_PER_BATCH):
            jobs.append(rows[b0 : b0 + SERIES_PER_BATCH])
    for rows in tqdm(jobs, desc=desc, disable=not progress, leave=False):
        mask = usable[rows[0]]
        n = int(mask.sum())
        if n < MIN_POINTS or np.unique(t[mask]).size < 2:
            for s in rows:
                out[s] = {"n_points": n, "flags": "few_points;no_fit" if n < FEW_POINTS else "no_fit",
                          "t_min": float(t[0]), "t_max": float(t[-1]), "monotone": False}
            continue
        fits = fit_power_law_many(t[mask], y[rows][:, mask], n_boot=n_boot, seed=seed)
        dropped = not mask.all()
        for s, f in zip(rows, fits, strict=True):
            flags = (*f.flags, "dropped_points") if dropped else f.flags
            out[s] = {**f.__dict__, "flags": ";".join(flags)}
    return out


def fit_run(
    run_dir: str | os.PathLike,
    *,
    time_axis: str = "auto",
    t_min: float | None = None,
    t_max: float | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> RunFits:
    """Fit a run directory and write RUN/fits.parquet and RUN/fits.json (see module docstring)."""
    run_dir = Path(run_dir)
    manifest = results.read_manifest(run_dir)
    df = results.read_results(run_dir)
    ck = _checkpoints(df)
    axis = _time_axis(ck, time_axis)
    t_all = ck[axis].to_numpy(dtype=float)
    win = _window(ck, t_all, manifest, t_min, t_max)
    t = t_all[win]
    last_step = ck["step"].to_numpy()[win][-1]

    wide = df.pivot_table(index=KEYS, columns="step", values="value", aggfunc="first", sort=True)
    wide = wide.reindex(columns=ck["step"].to_numpy())
    values = wide.to_numpy(dtype=float)  # (R, T) every metric of every site over checkpoints
    keys = wide.index.to_frame(index=False)
    keys["layer"] = keys["layer"].astype(np.int64)
    keys["head"] = keys["head"].astype(np.int64)
    site_of = list(zip(keys["site_kind"], keys["layer"], keys["head"], strict=True))
    metric = keys["metric"].to_numpy()
    last_col = values[:, int(np.flatnonzero(ck["step"].to_numpy() == last_step)[0])]
    at_last = dict(zip(zip(site_of, metric, strict=True), last_col, strict=True))

    def site_value(site: tuple, name: str) -> float:
        return float(at_last.get((site, name), np.nan))

    rows = []
    grow = np.flatnonzero(np.isin(metric, GROWTH_METRICS))
    fits = _fit_series(t, values[grow][:, win], n_boot, seed, progress, "growth fits")
    for r, fit in zip(grow, fits, strict=True):
        rows.append({"fit": "growth", **keys.iloc[r].to_dict(), **fit,
                     "first_value": values[r, 0], "final_value": values[r, -1]})

    # late logit_std fits -> site classes
    std_rows = np.flatnonzero(metric == "logit_std")
    late = _late(t)
    late_fits = _fit_series(t[late], values[std_rows][:, win][:, late], n_boot, seed, progress,
                            "late fits")
    sites = []
    for r, fit in zip(std_rows, late_fits, strict=True):
        site = site_of[r]
        lo = fit.get("alpha_lo", np.nan)
        sites.append({
            "site_kind": site[0], "layer": site[1], "head": site[2],
            "peaked_final": site_value(site, "peaked"),
            "alpha_late": fit.get("alpha", np.nan), "alpha_late_lo": lo,
            "alpha_late_hi": fit.get("alpha_hi", np.nan),
            "site_class": classify.classify(site_value(site, "peaked"), lo),
            "sensitivity": site_value(site, "sensitivity"),
        })
    sites_df = pd.DataFrame(sites, columns=[
        "site_kind", "layer", "head", "peaked_final", "alpha_late", "alpha_late_lo",
        "alpha_late_hi", "site_class", "sensitivity"])
    site_class = {(s["site_kind"], s["layer"], s["head"]): s["site_class"] for s in sites}

    loss_fit = None
    loss_row = np.flatnonzero((metric == "loss") & (keys["site_kind"].to_numpy() == "lm_head"))
    if len(loss_row):
        r = loss_row[0]
        loss_fit = fit_loss_law(t, values[r, win], n_boot=n_boot, seed=seed)
        rows.append({"fit": "loss", **keys.iloc[r].to_dict(), **loss_fit.__dict__,
                     "flags": ";".join(loss_fit.flags),
                     "first_value": values[r, 0], "final_value": values[r, -1]})

    table = pd.DataFrame(rows)
    for col in ("L0", "L0_lo", "L0_hi", "alpha", "alpha_lo", "alpha_hi", "c", "r2"):
        table[col] = table[col].astype(float) if col in table else np.nan
    table["time_axis"] = axis
    table["site_class"] = [
        site_class.get((k, la, h), "") if (f == "growth" and m == "logit_std") else ""
        for f, k, la, h, m in zip(table["fit"], table["site_kind"], table["layer"],
                                  table["head"], table["metric"], strict=True)
    ]
    table["sensitivity"] = [site_value((k, la, h), "sensitivity") for k, la, h in
                            zip(table["site_kind"], table["layer"], table["head"], strict=True)]
    table["monotone"] = table["monotone"].astype(bool)
    table = table[FITS_SCHEMA.names].sort_values(["fit", *KEYS], kind="stable")
    table = table.reset_index(drop=True)

    verdict = _verdict(axis, loss_fit, sites_df, bool(results.read_failures(run_dir)))
    results.write_parquet(run_dir / results.FITS, table, FITS_SCHEMA)
    results.write_json(run_dir / results.FITS_JSON, verdict)
    return RunFits(
        run_dir=run_dir,
        model=str(manifest.get("model", "")),
        time_axis=axis,
        t_min=float(t[0]),
        t_max=float(t[-1]),
        n_points=int(win.sum()),
        table=table,
        sites=sites_df,
        loss=loss_fit,
        verdict=verdict,
    )


def _json_float(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _verdict(axis: str, loss: LossFit | None, sites: pd.DataFrame, failures: bool) -> dict:
    flags = []
    if loss is None:
        flags.append("no_loss")
        loss_block = None
    else:
        flags.extend(f"loss_{f}" for f in loss.flags)
        loss_block = {
            "alpha": _json_float(loss.alpha),
            "alpha_lo": _json_float(loss.alpha_lo),
            "alpha_hi": _json_float(loss.alpha_hi),
            "L0": _json_float(loss.L0),
            "third_in_ci": bool(loss.third_in_ci),
            "third_distance_ci": _json_float(loss.third_distance_ci),
        }
    if not np.isfinite(sites["sensitivity"].to_numpy(dtype=float)).any():
        flags.append("no_sensitivity")
    if (sites["site_class"] == "").any():
        flags.append("unclassified_sites")
    if failures:
        flags.append("failed_checkpoints")
    return {
        "format": results.FORMAT,
        "time_axis": axis,
        "loss": loss_block,
        "bottleneck": classify.bottleneck(sites),
        "flags": flags,
    }
