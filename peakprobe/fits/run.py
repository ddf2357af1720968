"""Fitting a whole run directory: `fit_run` reads the sweep's results, fits every site's growth,
gain and the loss law, judges every exponent against 1/3, decides the bottleneck, and writes
`fits.parquet` and `fits.json` (formats in docs/architecture.md).

Time axis: ``auto`` is tau when every checkpoint has a finite tau, else step. The window,
excluded duplicates, loss spikes and the loss scan are described in `window`.

Growth fits (m = c t^alpha) are made for vocab.GROWTH_METRICS; checkpoints where a metric is
missing or not positive are left out of that series' fit (flag ``dropped_points``); a series
with fewer than 4 usable points gets a row of NaNs flagged ``no_fit``. The loss law is fitted
to the LM head's `loss`.

Gain fits: G = c t^-alpha for every site whose results carry vocab.GAIN; ``alpha`` is the decay
exponent (positive when G falls). The share of a gain site is G(t_end) / (L - L0)(t_end), both
read off their fitted laws at the window's last checkpoint, with a bootstrap interval (the gain
and loss refits paired by index) and a one-sided p-value of "share <= GAIN_SHARE_MIN" (normal
tail on log share with the bootstrap standard error). "Still growing" is the one-sided p-value
of "late logit_std alpha <= GROWTH_FLOOR" (late fit: second half of the window in log time, at
least 6 checkpoints), likewise. Growth p-values get Benjamini-Hochberg q-values over all sites
with a logit_std; share p-values within three families (heads; layer groups; the whole-kind
sites attn_all and the LM head); see `classify`.

Three-way verdicts (`third.judge_third`, band ``band``) are given for the loss, every gain and
every logit-magnitude growth (vocab.MAGNITUDE_METRICS). first_value / final_value are the run's
first and last kept checkpoints; `peaked`, `sensitivity` are read at the window's last one.

All bootstrap draws depend only on (seed, n_boot, number of points), so the same results give
the same bytes.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from peakprobe import results, vocab
from peakprobe.config import FitConfig
from peakprobe.results import FITS_SCHEMA

from . import classify, window
from .common import FEW_POINTS, FitError, bh_qvalues, p_at_most, percentile_interval
from .growth import MIN_POINTS, fit_power_law_boot
from .loss import MIN_POINTS as LOSS_MIN_POINTS
from .loss import LossFit, fit_loss_law_boot
from .third import judge_third

FITS_JSON_FORMAT = 2
LATE_MIN_POINTS = 6
SERIES_PER_BATCH = 64
KEYS = ["site_kind", "layer", "head", "metric"]
SITE_KEYS = ["site_kind", "layer", "head"]
#: the families of gain-share tests, each under its own Benjamini-Hochberg control
SHARE_FAMILIES = ((vocab.ATTN,), (vocab.ATTN_LAYER,), (vocab.ATTN_ALL, vocab.LM_HEAD), (vocab.ROUTER,))


@dataclass
class RunFits:
    """Everything `fit_run` found: the fits.parquet table, per-site facts, the loss fit and
    the fits.json document (``verdict``)."""

    run_dir: Path
    model: str
    time_axis: str
    t_min: float
    t_max: float
    n_points: int
    table: pd.DataFrame  # fits.parquet, one row per fit
    sites: pd.DataFrame  # one row per site: peaked, class, late alpha, share, gain exponent
    loss: LossFit | None
    verdict: dict  # fits.json
    band: tuple[float, float] = vocab.BAND
    step_min: int = 0
    step_max: int = 0
    excluded: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # fits that lacked points (fits.json "skipped")


def _checkpoints(df: pd.DataFrame) -> pd.DataFrame:
    ck = df.groupby("step", sort=True).agg(tau=("tau", "first"), revision=("revision", "first"))
    return ck.reset_index()


def _late(t: np.ndarray) -> np.ndarray:
    """Mask of the late half (in log time) of the window times t (n,), at least 6 points."""
    late = t >= math.sqrt(t[0] * t[-1])
    if late.sum() < LATE_MIN_POINTS:
        late = np.zeros(len(t), dtype=bool)
        late[-min(LATE_MIN_POINTS, len(t)):] = True
    return late


def _fit_series(t: np.ndarray, y: np.ndarray, n_boot: int, seed: int, progress: bool,
                desc: str, keep_boot: bool = False) -> tuple[list[dict], list]:
    """Growth fits of rows y (S, n) on times t (n,); NaN / non-positive points are dropped.

    Rows sharing the same usable points are fitted together. With ``keep_boot`` the second
    list holds, per row, (bootstrap intercepts (B,), slopes (B,), xbar) or None."""
    usable = np.isfinite(y) & (y > 0)  # (S, n)
    out: list[dict] = [{} for _ in range(len(y))]
    boots: list = [None] * len(y)
    patterns: dict[bytes, list[int]] = {}
    for s in range(len(y)):
        patterns.setdefault(usable[s].tobytes(), []).append(s)
    jobs = [rows[b0 : b0 + SERIES_PER_BATCH] for rows in patterns.values()
            for b0 in range(0, len(rows), SERIES_PER_BATCH)]
    for rows in tqdm(jobs, desc=desc, disable=not progress, leave=False):
        mask = usable[rows[0]]
        n = int(mask.sum())
        if n < MIN_POINTS or np.unique(t[mask]).size < 2:
            for s in rows:
                out[s] = {"n_points": n, "flags": "few_points;no_fit" if n < FEW_POINTS else "no_fit",
                          "t_min": float(t[0]), "t_max": float(t[-1]), "monotone": False}
            continue
        fits, boot = fit_power_law_boot(t[mask], y[rows][:, mask], n_boot=n_boot, seed=seed)
        dropped = not mask.all()
        for j, (s, f) in enumerate(zip(rows, fits, strict=True)):
            flags = (*f.flags, "dropped_points") if dropped else f.flags
            out[s] = {**f.__dict__, "flags": ";".join(flags)}
            if keep_boot and boot is not None:
                boots[s] = (boot.icept[j], boot.slope[j], boot.xbar)
    return out, boots


def fit_run(run_dir: str | os.PathLike, config: FitConfig | None = None, *, progress: bool = False,
            **overrides) -> RunFits:
    """Fit a run directory and write RUN/fits.parquet and RUN/fits.json (module docstring).

    ``config`` (default ``FitConfig()``), with any of its fields replaced by ``overrides``
    (``fit_run(run, n_boot=200)``). A fit whose window holds too few points is skipped and
    listed in ``RunFits.skipped`` (and fits.json's ``skipped``); the others still run."""
    config = replace(config or FitConfig(), **overrides)
    band, n_boot, seed = config.band, config.n_boot, config.seed
    time_axis, t_min, t_max = config.time_axis, config.t_min, config.t_max
    t_min_step, t_max_step = config.t_min_step, config.t_max_step
    run_dir = Path(run_dir)
    manifest = results.read_manifest(run_dir)
    df = results.read_results(run_dir)
    flagged = window.read_duplicates(run_dir)
    excluded = window.excluded_records(flagged, df[["revision", "step"]].drop_duplicates())
    df = df[~df["revision"].isin(set(flagged))]
    if df.empty:
        raise FitError(f"every checkpoint of {run_dir} is flagged as a duplicate in integrity.json")
    ck = _checkpoints(df)
    axis = window.time_axis(ck, time_axis)
    win = window.choose(ck, axis, manifest, t_min=t_min, t_max=t_max, t_min_step=t_min_step,
                        t_max_step=t_max_step)
    keep = win.keep
    steps_all = ck["step"].to_numpy()
    t = ck[axis].to_numpy(dtype=float)[keep]
    steps = steps_all[keep]
    t_end = float(t[-1])
    positive = steps_all[ck[axis].to_numpy(dtype=float) > 0]
    skipped = []
    if len(t) < MIN_POINTS:
        skipped.append(window.skipped_fit(vocab.FIT_GROWTH, len(t), MIN_POINTS, steps, positive))

    wide = df.pivot_table(index=KEYS, columns="step", values="value", aggfunc="first", sort=True)
    wide = wide.reindex(columns=steps_all)
    values = wide.to_numpy(dtype=float)  # (R, T) every metric of every site over checkpoints
    keys = wide.index.to_frame(index=False)
    keys["layer"] = keys["layer"].astype(np.int64)
    keys["head"] = keys["head"].astype(np.int64)
    site_of = list(zip(keys["site_kind"], keys["layer"], keys["head"], strict=True))
    metric = keys["metric"].to_numpy()
    last_col = values[:, int(np.flatnonzero(steps_all == steps[-1])[0])]
    at_last: dict[tuple, dict[str, float]] = {}
    for site, name, v in zip(site_of, metric, last_col, strict=True):
        at_last.setdefault(site, {})[name] = float(v)
    available = set(metric)

    rows = []  # fits.parquet rows, before the per-site columns

    def add(fit: str, r: int, d: dict) -> None:
        rows.append({"fit": fit, **keys.iloc[r].to_dict(), **d,
                     "first_value": values[r, 0], "final_value": values[r, -1]})

    grow = np.flatnonzero(np.isin(metric, vocab.GROWTH_METRICS))
    fits, _ = _fit_series(t, values[grow][:, keep], n_boot, seed, progress, "growth fits")
    for r, fit in zip(grow, fits, strict=True):
        add(vocab.FIT_GROWTH, r, fit)
    growth_of = {site_of[r]: fit for r, fit in zip(grow, fits, strict=True)
                 if metric[r] == vocab.LOGIT_STD}

    # late logit_std fits -> "still growing" p-values
    std_rows = np.flatnonzero(metric == vocab.LOGIT_STD)
    late_fits, late_boots = _fit_series(t[_late(t)], values[std_rows][:, keep][:, _late(t)],
                                        n_boot, seed, progress, "late fits", keep_boot=True)
    late_of = {}
    for r, fit, boot in zip(std_rows, late_fits, late_boots, strict=True):
        p = (float(p_at_most(np.array([fit["alpha"]]), boot[1][None, :], vocab.GROWTH_FLOOR)[0])
             if boot else math.nan)
        late_of[site_of[r]] = {"alpha_late": fit.get("alpha", math.nan),
                               "alpha_late_lo": fit.get("alpha_lo", math.nan),
                               "alpha_late_hi": fit.get("alpha_hi", math.nan), "p_growing": p}

    loss_fit, loss_boot, loss_row = None, None, None
    lr = np.flatnonzero((metric == vocab.LOSS) & (keys["site_kind"].to_numpy() == vocab.LM_HEAD))
    if len(lr):
        loss_row = int(lr[0])
        usable = int((np.isfinite(values[loss_row, keep]) & (values[loss_row, keep] > 0)).sum())
        if usable < LOSS_MIN_POINTS:
            skipped.append(window.skipped_fit(vocab.FIT_LOSS, usable, LOSS_MIN_POINTS, steps, positive))
        else:
            loss_fit, loss_boot = fit_loss_law_boot(t, values[loss_row, keep], n_boot=n_boot,
                                                    seed=seed)
            add(vocab.FIT_LOSS, loss_row, {**loss_fit.__dict__, "flags": ";".join(loss_fit.flags)})

    # gain fits: G = c t^-alpha (alpha = minus the fitted slope) and shares of L - L0
    gain_rows = np.flatnonzero(metric == vocab.GAIN)
    gfits, gboots = _fit_series(t, values[gain_rows][:, keep], n_boot, seed, progress,
                                "gain fits", keep_boot=True)
    gain_of = {}
    r_end = loss_fit.c * t_end ** -loss_fit.alpha if loss_fit is not None else math.nan
    r_boot = loss_boot.reducible_at(t_end) if loss_boot is not None else None
    for r, fit, boot in zip(gain_rows, gfits, gboots, strict=True):
        if "alpha" in fit:
            fit = {**fit, "alpha": -fit["alpha"], "alpha_lo": -fit["alpha_hi"],
                   "alpha_hi": -fit["alpha_lo"]}
        add(vocab.FIT_GAIN, r, fit)
        share = lo = hi = p = math.nan
        if "alpha" in fit and math.isfinite(r_end):
            share = fit["c"] * t_end ** -fit["alpha"] / r_end
            if boot is not None and r_boot is not None:
                g_end = np.exp(boot[0] + boot[1] * (math.log(t_end) - boot[2]))  # (B,)
                shares = g_end / r_boot
                lo, hi = (float(v) for v in percentile_interval(shares, vocab.CI_LEVEL))
                p = float(p_at_most(np.array([math.log(share)]), np.log(shares)[None, :],
                                    math.log(vocab.GAIN_SHARE_MIN))[0])
        gain_of[site_of[r]] = {"share": share, "share_lo": lo, "share_hi": hi, "p_share": p,
                               "alpha_gain": fit.get("alpha", math.nan),
                               "alpha_gain_lo": fit.get("alpha_lo", math.nan),
                               "alpha_gain_hi": fit.get("alpha_hi", math.nan)}

    sites = _sites(sorted(set(site_of)), at_last, available, late_of, gain_of, band)
    attn_growth = _attention_growth(sites, values, site_of, metric, keep, t, n_boot, seed)
    kinds = _kinds(sites, growth_of, attn_growth, band)
    table = _table(rows, sites, band, axis)

    loss_series = values[loss_row, keep] if loss_row is not None else np.array([])
    spikes = window.spikes(loss_series, steps, t, ck["revision"].to_numpy()[keep])
    scan = (window.loss_scan(t, loss_series, steps, loss_fit, n_boot=n_boot, seed=seed, band=band)
            if loss_fit is not None else {"drift": False, "rows": []})
    doc = _document(
        axis=axis, band=band, win=win, t=t, steps=steps, excluded=excluded, spikes=spikes,
        scan=scan, loss=loss_fit, sites=sites, kinds=kinds, available=available,
        failures=bool(results.read_failures(run_dir)), skipped=skipped,
    )
    results.write_parquet(run_dir / results.FITS, table, FITS_SCHEMA)
    results.write_json(run_dir / results.FITS_JSON, doc)
    return RunFits(
        run_dir=run_dir, model=str(manifest.get("model", "")), time_axis=axis,
        t_min=float(t[0]), t_max=t_end, n_points=int(keep.sum()), table=table, sites=sites,
        loss=loss_fit, verdict=doc, band=band, step_min=int(steps[0]), step_max=int(steps[-1]),
        excluded=excluded, skipped=skipped,
    )


def _sites(site_keys: list[tuple], at_last: dict, available: set[str], late_of: dict,
           gain_of: dict, band: tuple[float, float]) -> pd.DataFrame:
    """One row per site: peaked, class, late growth test, gain share test (q-values: BH)."""
    recs = []
    for site in site_keys:
        kind, layer, head = site
        crit = classify.peaked_criteria(kind, available)
        rec = {"site_kind": kind, "layer": int(layer), "head": int(head),
               "label": vocab.site_label(kind, layer, head),
               "peaked": classify.is_peaked(at_last.get(site, {}), crit),
               "sensitivity": at_last.get(site, {}).get(vocab.SENSITIVITY, math.nan),
               **{k: math.nan for k in ("alpha_late", "alpha_late_lo", "alpha_late_hi",
                                        "p_growing", "share", "share_lo", "share_hi",
                                        "p_share", "alpha_gain", "alpha_gain_lo",
                                        "alpha_gain_hi")},
               **late_of.get(site, {}), **gain_of.get(site, {})}
        rec["gain_verdict"] = (judge_third(rec["alpha_gain_lo"], rec["alpha_gain_hi"], band)
                               if site in gain_of else "")
        recs.append(rec)
    sites = pd.DataFrame(recs)
    heads = sites["site_kind"] == vocab.ATTN
    head_peaked = sites.loc[heads, "peaked"]
    any_head = bool(head_peaked.fillna(False).astype(bool).any()) if heads.any() else None
    for kind in (vocab.ATTN_LAYER, vocab.ATTN_ALL):  # a group is peaked when a head of it is
        for i in np.flatnonzero(sites["site_kind"] == kind):
            if kind == vocab.ATTN_LAYER:
                mine = sites.loc[heads & (sites["layer"] == sites.at[i, "layer"]), "peaked"]
                sites.at[i, "peaked"] = bool(mine.fillna(False).astype(bool).any()) if len(mine) else None
            else:
                sites.at[i, "peaked"] = any_head
    sites["q_growing"] = bh_qvalues(sites["p_growing"].to_numpy(dtype=float))
    # BH within each family of gain sites: heads, layer groups, whole kinds (attn_all, LM head)
    q = np.full(len(sites), np.nan)
    for family in SHARE_FAMILIES:
        rows = np.flatnonzero(sites["site_kind"].isin(family).to_numpy())
        q[rows] = bh_qvalues(sites["p_share"].to_numpy(dtype=float)[rows])
    sites["q_share"] = q
    sites["site_class"] = [
        classify.classify(p, q) if k in vocab.CLASSIFIED_KINDS and math.isfinite(a) else ""
        for k, p, q, a in zip(sites["site_kind"], sites["peaked"], sites["q_growing"],
                              sites["alpha_late"], strict=True)
    ]
    return sites


def _attention_growth(sites: pd.DataFrame, values: np.ndarray, site_of: list, metric: np.ndarray,
                      keep: np.ndarray, t: np.ndarray, n_boot: int, seed: int) -> dict | None:
    """Growth of the mean logit_std over the concentrating heads, else the peaked heads, else
    all heads."""
    heads = sites[sites["site_kind"] == vocab.ATTN]
    if heads.empty:
        return None
    conc = heads[heads["site_class"] == "concentrating"]
    peaked = heads[heads["peaked"].fillna(False).astype(bool)]
    pick, of = ((conc, "concentrating heads") if len(conc) else
                (peaked, "peaked heads") if len(peaked) else (heads, "heads"))
    chosen = {(vocab.ATTN, int(r.layer), int(r.head)) for r in pick.itertuples()}
    rows = [i for i, (s, m) in enumerate(zip(site_of, metric, strict=True))
            if m == vocab.LOGIT_STD and s in chosen]
    if not rows:
        return None
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a checkpoint missing every head: NaN
        mean = np.nanmean(values[rows][:, keep], axis=0)[None, :]
    fit = _fit_series(t, mean, n_boot, seed, False, "")[0][0]
    return {"alpha": fit.get("alpha", math.nan), "alpha_lo": fit.get("alpha_lo", math.nan),
            "alpha_hi": fit.get("alpha_hi", math.nan), "n_heads": len(rows),
            "of": of}


def _kinds(sites: pd.DataFrame, growth_of: dict, attn_growth: dict | None,
           band: tuple[float, float]) -> dict[str, dict]:
    """fits.json's bottleneck.kinds: per softmax kind, peakedness, share and exponents."""
    out = {}
    heads = sites[sites["site_kind"] == vocab.ATTN]
    groups = sites[sites["site_kind"].isin([vocab.ATTN, vocab.ATTN_LAYER, vocab.ATTN_ALL])]
    lm = sites[sites["site_kind"] == vocab.LM_HEAD]
    if len(heads) or len(groups):
        sig = groups[(groups["q_share"] <= vocab.FDR) & groups["peaked"].fillna(False).astype(bool)]
        rep = groups[groups["site_kind"] == vocab.ATTN_ALL]
        rep = rep[np.isfinite(rep["share"].to_numpy(dtype=float))]
        if rep.empty:
            pool = sig[sig["site_kind"] == vocab.ATTN]
            pool = pool if len(pool) else heads[np.isfinite(heads["share"].to_numpy(dtype=float))]
            rep = pool.sort_values("share", ascending=False, kind="stable")
        g = attn_growth or {}
        out[vocab.BOTTLENECK_ATTENTION] = _kind_block(
            heads, rep.iloc[0] if len(rep) else None, bool(len(sig)), g, band,
            f"mean logit_std over {g.get('n_heads', 0)} {g.get('of', 'heads')}")
    if len(lm):
        row = lm.iloc[0]
        g = growth_of.get((vocab.LM_HEAD, -1, -1), {})
        sig = bool(row["q_share"] <= vocab.FDR and row["peaked"])
        out[vocab.BOTTLENECK_LM_HEAD] = _kind_block(lm, row if math.isfinite(row["share"]) else None,
                                                    sig, g, band, "LM head logit_std")
    return out


def _kind_block(members: pd.DataFrame, rep: pd.Series | None, significant: bool, growth: dict,
                band: tuple[float, float], growth_of: str) -> dict:
    peaked = members["peaked"].fillna(False).astype(bool)
    def f(v) -> float | None:
        return float(v) if v is not None and math.isfinite(float(v)) else None
    get = (lambda k: f(rep[k])) if rep is not None else (lambda k: None)
    a_lo, a_hi = f(growth.get("alpha_lo", math.nan)), f(growth.get("alpha_hi", math.nan))
    return {
        "peaked": bool(peaked.any()), "n_sites": int(len(members)), "n_peaked": int(peaked.sum()),
        "site": str(rep["label"]) if rep is not None else None, "significant": significant,
        **{k: get(k) for k in ("share", "share_lo", "share_hi", "q_share", "alpha_gain",
                               "alpha_gain_lo", "alpha_gain_hi")},
        "gain_verdict": str(rep["gain_verdict"]) if rep is not None else None,
        "alpha_growth": f(growth.get("alpha", math.nan)), "alpha_growth_lo": a_lo,
        "alpha_growth_hi": a_hi, "growth_verdict": judge_third(a_lo, a_hi, band),
        "growth_of": growth_of,
    }


def _table(rows: list[dict], sites: pd.DataFrame, band: tuple[float, float],
           axis: str) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    for col in ("L0", "L0_lo", "L0_hi", "alpha", "alpha_lo", "alpha_hi", "c", "r2"):
        table[col] = table[col].astype(float) if col in table else np.nan
    table["time_axis"] = axis
    judged = (table["fit"] != "growth") | table["metric"].isin(vocab.MAGNITUDE_METRICS)
    table["verdict"] = [judge_third(lo, hi, band) if j else "" for j, lo, hi in
                        zip(judged, table["alpha_lo"], table["alpha_hi"], strict=True)]
    table["band_lo"], table["band_hi"] = band
    table["third_in_ci"] = (table["alpha_lo"] <= vocab.THIRD) & (vocab.THIRD <= table["alpha_hi"])
    per_site = sites.set_index(SITE_KEYS)
    idx = pd.MultiIndex.from_frame(table[SITE_KEYS])
    table["peaked"] = per_site["peaked"].reindex(idx).fillna(False).astype(bool).to_numpy()
    table["sensitivity"] = per_site["sensitivity"].reindex(idx).to_numpy(dtype=float)
    std = (table["fit"] == vocab.FIT_GROWTH) & (table["metric"] == vocab.LOGIT_STD)
    gain = table["fit"] == vocab.FIT_GAIN
    for cols, mask in ((("alpha_late", "alpha_late_lo", "alpha_late_hi", "p_growing",
                         "q_growing"), std),
                       (("share", "share_lo", "share_hi", "p_share", "q_share"), gain)):
        for col in cols:
            table[col] = np.where(mask, per_site[col].reindex(idx).to_numpy(dtype=float), np.nan)
    table["site_class"] = np.where(std, per_site["site_class"].reindex(idx).fillna("").to_numpy(), "")
    table["monotone"] = table["monotone"].astype(bool)
    table = table[FITS_SCHEMA.names].sort_values(["fit", *KEYS], kind="stable")
    return table.reset_index(drop=True)


def _document(*, axis: str, band: tuple[float, float], win: window.Window, t: np.ndarray,
              steps: np.ndarray, excluded: list, spikes: list, scan: dict,
              loss: LossFit | None, sites: pd.DataFrame, kinds: dict, available: set[str],
              failures: bool, skipped: list[dict]) -> dict:
    flags = [f"skipped_{s['fit']}" for s in skipped]
    if loss is None:
        flags.append("no_loss")
        loss_block = None
    else:
        flags.extend(f"loss_{f}" for f in loss.flags)
        loss_block = {
            **{k: float(getattr(loss, k)) for k in ("alpha", "alpha_lo", "alpha_hi", "L0",
                                                           "L0_lo", "L0_hi", "c", "t_min",
                                                           "t_max")},
            "verdict": judge_third(loss.alpha_lo, loss.alpha_hi, band),
            "third_in_ci": bool(loss.third_in_ci), "n_points": int(loss.n_points),
            "flags": list(loss.flags),
        }
    if scan["drift"]:
        flags.append("loss_alpha_drift")
    if spikes:
        flags.append("loss_spike")
    if excluded:
        flags.append("excluded_duplicates")
    has_gain = vocab.GAIN in available
    if not has_gain:
        flags.append("no_gain")
    if not np.isfinite(sites["sensitivity"].to_numpy(dtype=float)).any():
        flags.append("no_sensitivity")
    classifiable = sites["site_kind"].isin([vocab.ATTN, vocab.LM_HEAD])
    if (sites.loc[classifiable, "site_class"] == "").any():
        flags.append("unclassified_sites")
    if failures:
        flags.append("failed_checkpoints")
    has_peaked = bool(sites["peaked"].notna().any())
    verdict, reason = classify.decide(kinds, has_peaked_metric=has_peaked, has_gain=has_gain,
                                      has_loss=loss is not None,
                                      has_entropy_criterion=vocab.PEAKED_ENTROPY in available)
    heads = sites[sites["site_kind"] == vocab.ATTN]
    cls = heads["site_class"]
    return {
        "format": FITS_JSON_FORMAT,
        "band": [float(band[0]), float(band[1])],
        "ci_level": vocab.CI_LEVEL,
        "time_axis": axis,
        "window": {"t_min": float(t[0]), "t_max": float(t[-1]), "step_min": int(steps[0]),
                   "step_max": int(steps[-1]), "n_points": len(t), "start_rule": win.start_rule},
        "excluded": excluded,
        "spikes": spikes,
        "loss": loss_block,
        "loss_scan": scan,
        "skipped": skipped,
        "bottleneck": {
            "verdict": verdict,
            "reason": reason,
            "share_min": vocab.GAIN_SHARE_MIN,
            "fdr": vocab.FDR,
            "kinds": kinds,
            "peaked_criteria": {
                name: classify.peaked_criteria(kind, available)
                for name, kind in ((vocab.BOTTLENECK_ATTENTION, vocab.ATTN),
                                   (vocab.BOTTLENECK_LM_HEAD, vocab.LM_HEAD))},
            "n_heads": int(len(heads)),
            "n_peaked": int(heads["peaked"].fillna(False).astype(bool).sum()),
            "n_concentrating": int((cls == "concentrating").sum()),
            "n_saturated": int((cls == "saturated").sum()),
            "n_diffuse": int((cls == "diffuse").sum()),
            "n_share_significant": int((sites["q_share"] <= vocab.FDR).sum()),
            "top_sites": classify.top_sites(sites),
        },
        "flags": flags,
    }
