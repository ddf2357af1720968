"""Fitting a whole run directory: `fit_run` reads the sweep's results, fits every site's growth,
gain and the loss law, judges every exponent against 1/3, decides the bottleneck, and writes
`fits.parquet` and `fits.json` (formats in docs/architecture.md).

Time axis: ``auto`` is tau when every checkpoint has a finite tau, else step. The window,
excluded duplicates, loss spikes and the loss scan are described in `window`.

Growth fits (m = c t^alpha) are made for vocab.GROWTH_METRICS; checkpoints where a metric is
missing or not positive are left out of that series' fit (flag ``dropped_points``); a series
with fewer than 4 usable points gets a row of NaNs flagged ``no_fit``. The loss law is fitted
to the LM head's `loss`.

Gain fits: G = c t^-alpha for every site whose results carry vocab.GAIN (the LM head's
vocab.GAIN_AFTER_ATTENTION where present); ``alpha`` is the decay
exponent (positive when G falls). Each gain site's share of the loss decrease over the window
(the verdict's) and of L - L0 at the window's end (beside it) are `classify`'s, as are the
Benjamini-Hochberg families; they divide by the loss on the gains' own tokens (``_LossStage``). "Still growing" is the one-sided p-value of "late logit_std alpha
<= GROWTH_FLOOR" (late fit: second half of the window in log time, at least 6 checkpoints),
with Benjamini-Hochberg q-values over all sites with a logit_std.

`fit_run` is a pipeline of named stages: `_load_and_window`, `_growth_fits`, `_late_fits`,
`_loss_fit`, `_gain_shares`, then the per-site table (`_sites`, `classify.kind_blocks`, `_table`) and the
document (`_document`).

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from peakprobe import results, vocab
from peakprobe.config import FitConfig
from peakprobe.results import FITS_SCHEMA

from . import classify, window
from .common import FEW_POINTS, FitError, bh_qvalues, p_at_most
from .growth import MIN_POINTS, fit_power_law_boot
from .loss import MIN_POINTS as LOSS_MIN_POINTS
from .loss import LossFit, fit_loss_law_boot, loss_block
from .third import judge_third

FITS_JSON_FORMAT = 2
LATE_MIN_POINTS = 6
SERIES_PER_BATCH = 64
KEYS = ["site_kind", "layer", "head", "metric"]
SITE_KEYS = ["site_kind", "layer", "head"]


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


@dataclass
class _Frame:
    """A run's results over its checkpoints, windowed: what every fitting stage reads."""

    run_dir: Path
    manifest: dict
    axis: str
    win: window.Window
    revisions: np.ndarray  # (T_all,) each checkpoint's revision
    steps_all: np.ndarray  # (T_all,) every kept checkpoint's step
    keep: np.ndarray  # (T_all,) bool, the fit window
    t: np.ndarray  # (n,) the window's times
    values: np.ndarray  # (R, T_all) every metric of every site over the checkpoints
    keys: pd.DataFrame  # (R,) site_kind, layer, head, metric
    excluded: list[dict]
    skipped: list[dict]
    positive: np.ndarray  # steps with a positive time

    @property
    def steps(self) -> np.ndarray:
        return self.steps_all[self.keep]

    @property
    def site_of(self) -> list[tuple]:
        k = self.keys
        return list(zip(k["site_kind"], k["layer"], k["head"], strict=True))

    @property
    def metric(self) -> np.ndarray:
        return self.keys["metric"].to_numpy()

    def rows(self, metric: str) -> np.ndarray:
        return np.flatnonzero(self.metric == metric)

    def at_last(self) -> dict[tuple, dict[str, float]]:
        """Per site, every metric's value at the window's last checkpoint."""
        col = self.values[:, int(np.flatnonzero(self.steps_all == self.steps[-1])[0])]
        out: dict[tuple, dict[str, float]] = {}
        for site, name, v in zip(self.site_of, self.metric, col, strict=True):
            out.setdefault(site, {})[name] = float(v)
        return out


@dataclass
class _LossStage:
    """The loss-law fit and its bootstrap, and the LM head's loss series over the window; the
    law the gains' shares divide by (``share``: fitted to vocab.ATTRIBUTION_LOSS, the gains' own
    tokens, where the run has it; else the run's)."""

    fit: LossFit | None = None
    boot: object = None
    series: np.ndarray = field(default_factory=lambda: np.array([]))  # (n,) or empty
    share: tuple = (None, None)  # (LossFit, bootstrap)


def fit_run(run_dir: str | os.PathLike, config: FitConfig | None = None, *,
            progress: bool = False) -> RunFits:
    """Fit a run directory and write RUN/fits.parquet and RUN/fits.json (module docstring).

    A fit whose window holds too few points is skipped and listed in ``RunFits.skipped`` (and
    fits.json's ``skipped``); the others still run."""
    config = config or FitConfig()
    frame = _load_and_window(Path(run_dir), config)
    rows: list[dict] = []  # fits.parquet rows, before the per-site columns
    growth_of = _growth_fits(frame, config, progress, rows)
    late_of = _late_fits(frame, config, progress)
    loss = _loss_fit(frame, config, rows)
    gain_of = _gain_shares(frame, config, progress, rows, loss)
    sites = _sites(sorted(set(frame.site_of)), frame.at_last(), set(frame.metric), late_of,
                   gain_of, config.band)
    attn_growth = _attention_growth(sites, frame, config.n_boot, config.seed)
    kinds = classify.kind_blocks(sites, growth_of, attn_growth, config.band)
    table = _table(rows, sites, config.band, frame.axis)
    doc = _document(frame, config, loss, sites, kinds)
    results.write_parquet(frame.run_dir / results.FITS, table, FITS_SCHEMA)
    results.write_json(frame.run_dir / results.FITS_JSON, doc)
    t, steps = frame.t, frame.steps
    return RunFits(
        run_dir=frame.run_dir, model=str(frame.manifest.get("model", "")), time_axis=frame.axis,
        t_min=float(t[0]), t_max=float(t[-1]), n_points=len(t), table=table, sites=sites,
        loss=loss.fit, verdict=doc, band=config.band, step_min=int(steps[0]),
        step_max=int(steps[-1]), excluded=frame.excluded, skipped=frame.skipped,
    )


def _load_and_window(run_dir: Path, config: FitConfig) -> _Frame:
    """Read the results, drop flagged duplicates, choose the time axis and the window."""
    manifest = results.read_manifest(run_dir)
    df = results.read_results(run_dir)
    flagged = window.read_duplicates(run_dir)
    excluded = window.excluded_records(flagged, df[["revision", "step"]].drop_duplicates())
    df = df[~df["revision"].isin(set(flagged))]
    if df.empty:
        raise FitError(f"every checkpoint of {run_dir} is flagged as a duplicate in integrity.json")
    ck = (df.groupby("step", sort=True)
          .agg(tau=("tau", "first"), revision=("revision", "first")).reset_index())
    axis = window.time_axis(ck, config.time_axis)
    win = window.choose(ck, axis, manifest, t_min=config.t_min, t_max=config.t_max,
                        t_min_step=config.t_min_step, t_max_step=config.t_max_step)
    steps_all = ck["step"].to_numpy()
    t_all = ck[axis].to_numpy(dtype=float)
    wide = df.pivot_table(index=KEYS, columns="step", values="value", aggfunc="first", sort=True)
    wide = wide.reindex(columns=steps_all)
    keys = wide.index.to_frame(index=False)
    keys["layer"] = keys["layer"].astype(np.int64)
    keys["head"] = keys["head"].astype(np.int64)
    frame = _Frame(run_dir=run_dir, manifest=manifest, axis=axis, win=win,
                   revisions=ck["revision"].to_numpy(), steps_all=steps_all, keep=win.keep,
                   t=t_all[win.keep], values=wide.to_numpy(dtype=float), keys=keys,
                   excluded=excluded, skipped=[], positive=steps_all[t_all > 0])
    if len(frame.t) < MIN_POINTS:
        frame.skipped.append(window.skipped_fit(vocab.FIT_GROWTH, len(frame.t), MIN_POINTS,
                                                frame.steps, frame.positive))
    return frame


def _add(rows: list[dict], frame: _Frame, fit: str, r: int, d: dict) -> None:
    """Append one fits.parquet row: the fit of row ``r``'s series."""
    rows.append({"fit": fit, **frame.keys.iloc[r].to_dict(), **d,
                 "first_value": frame.values[r, 0], "final_value": frame.values[r, -1]})


def _growth_fits(frame: _Frame, config: FitConfig, progress: bool, rows: list[dict]) -> dict:
    """Growth fits m = c t^alpha of vocab.GROWTH_METRICS; returns the logit_std fit per site."""
    grow = np.flatnonzero(np.isin(frame.metric, vocab.GROWTH_METRICS))
    fits, _ = _fit_series(frame.t, frame.values[grow][:, frame.keep], config.n_boot, config.seed,
                          progress, "growth fits")
    for r, fit in zip(grow, fits, strict=True):
        _add(rows, frame, vocab.FIT_GROWTH, r, fit)
    site_of, metric = frame.site_of, frame.metric
    return {site_of[r]: fit for r, fit in zip(grow, fits, strict=True)
            if metric[r] == vocab.LOGIT_STD}


def _late_fits(frame: _Frame, config: FitConfig, progress: bool) -> dict:
    """Late logit_std fits (second half of the window in log time) and their "still growing"
    p-values, per site."""
    late = _late(frame.t)
    std_rows = frame.rows(vocab.LOGIT_STD)
    fits, boots = _fit_series(frame.t[late], frame.values[std_rows][:, frame.keep][:, late],
                              config.n_boot, config.seed, progress, "late fits", keep_boot=True)
    site_of, out = frame.site_of, {}
    for r, fit, boot in zip(std_rows, fits, boots, strict=True):
        p = (float(p_at_most(np.array([fit["alpha"]]), boot[1][None, :], vocab.GROWTH_FLOOR)[0])
             if boot else math.nan)
        out[site_of[r]] = {"alpha_late": fit.get("alpha", math.nan),
                           "alpha_late_lo": fit.get("alpha_lo", math.nan),
                           "alpha_late_hi": fit.get("alpha_hi", math.nan), "p_growing": p}
    return out


def _loss_fit(frame: _Frame, config: FitConfig, rows: list[dict]) -> _LossStage:
    """The loss law L = L0 + c t^-alpha on the LM head's loss over the window."""
    lr = np.flatnonzero((frame.metric == vocab.LOSS)
                        & (frame.keys["site_kind"].to_numpy() == vocab.LM_HEAD))
    if not len(lr):
        return _LossStage()
    row = int(lr[0])
    series = frame.values[row, frame.keep]
    usable = int((np.isfinite(series) & (series > 0)).sum())
    if usable < LOSS_MIN_POINTS:
        frame.skipped.append(window.skipped_fit(vocab.FIT_LOSS, usable, LOSS_MIN_POINTS,
                                                frame.steps, frame.positive))
        return _LossStage(series=series)
    fit, boot = fit_loss_law_boot(frame.t, series, n_boot=config.n_boot, seed=config.seed)
    _add(rows, frame, vocab.FIT_LOSS, row, {**fit.__dict__, "flags": ";".join(fit.flags)})
    ar = np.flatnonzero(frame.metric == vocab.ATTRIBUTION_LOSS)  # the LM head's only
    attr = frame.values[int(ar[0]), frame.keep] if len(ar) else np.array([])
    share = (fit_loss_law_boot(frame.t, attr, n_boot=config.n_boot, seed=config.seed)
             if int((np.isfinite(attr) & (attr > 0)).sum()) >= LOSS_MIN_POINTS else (fit, boot))
    return _LossStage(fit, boot, series, share)


def _gain_rows(frame: _Frame) -> np.ndarray:
    """The rows gain fits and shares read: each site's vocab.GAIN, the LM head's
    vocab.GAIN_AFTER_ATTENTION in its place where present (docs/attribution.md)."""
    site_of, after = frame.site_of, frame.rows(vocab.GAIN_AFTER_ATTENTION)
    swapped = {site_of[r] for r in after}
    return np.sort(np.r_[[r for r in frame.rows(vocab.GAIN) if site_of[r] not in swapped], after]).astype(int)


def _gain_shares(frame: _Frame, config: FitConfig, progress: bool, rows: list[dict],
                 loss: _LossStage) -> dict:
    """Gain fits G = c t^-alpha (alpha: minus the fitted slope) and, per gain site, its share
    of the loss decrease over the window (the verdict's) and its share of L - L0 at the end."""
    gain_rows = _gain_rows(frame)
    fits, boots = _fit_series(frame.t, frame.values[gain_rows][:, frame.keep], config.n_boot, config.seed, progress, "gain fits",
                              keep_boot=True)
    site_of, out = frame.site_of, {}
    t1, t2 = float(frame.t[0]), float(frame.t[-1])
    law, law_boot = loss.share
    for r, fit, boot in zip(gain_rows, fits, boots, strict=True):
        if "alpha" in fit:
            fit = {**fit, "alpha": -fit["alpha"], "alpha_lo": -fit["alpha_hi"],
                   "alpha_hi": -fit["alpha_lo"]}
        _add(rows, frame, vocab.FIT_GAIN, r, fit)
        out[site_of[r]] = {"gain_metric": str(frame.metric[r]),
                           **classify.drop_share(fit, boot, law, law_boot, t1, t2),
                           **classify.floor_share(fit, boot, law, law_boot, t2),
                           "alpha_gain": fit.get("alpha", math.nan),
                           "alpha_gain_lo": fit.get("alpha_lo", math.nan),
                           "alpha_gain_hi": fit.get("alpha_hi", math.nan)}
    return out


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
               "gain_metric": "",
               **{k: math.nan for k in ("alpha_late", "alpha_late_lo", "alpha_late_hi",
                                        "p_growing", *classify.SHARE_KEYS, "alpha_gain",
                                        "alpha_gain_lo", "alpha_gain_hi")},
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
    sites["q_share"] = classify.share_qvalues(sites)
    sites["site_class"] = [
        classify.classify(p, q) if k in vocab.CLASSIFIED_KINDS and math.isfinite(a) else ""
        for k, p, q, a in zip(sites["site_kind"], sites["peaked"], sites["q_growing"],
                              sites["alpha_late"], strict=True)
    ]
    return sites


def _attention_growth(sites: pd.DataFrame, frame: _Frame, n_boot: int, seed: int) -> dict | None:
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
    rows = [i for i, (s, m) in enumerate(zip(frame.site_of, frame.metric, strict=True))
            if m == vocab.LOGIT_STD and s in chosen]
    if not rows:
        return None
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a checkpoint missing every head: NaN
        mean = np.nanmean(frame.values[rows][:, frame.keep], axis=0)[None, :]
    fit = _fit_series(frame.t, mean, n_boot, seed, False, "")[0][0]
    return {"alpha": fit.get("alpha", math.nan), "alpha_lo": fit.get("alpha_lo", math.nan),
            "alpha_hi": fit.get("alpha_hi", math.nan), "n_heads": len(rows),
            "of": of}


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


def _flags(frame: _Frame, loss: LossFit | None, scan: dict, spikes: list,
           sites: pd.DataFrame) -> list[str]:
    """fits.json's run-level flags."""
    available = set(frame.metric)
    flags = [f"skipped_{s['fit']}" for s in frame.skipped]
    flags += ["no_loss"] if loss is None else [f"loss_{f}" for f in loss.flags]
    classifiable = sites["site_kind"].isin([vocab.ATTN, vocab.LM_HEAD])
    for flag, on in (("loss_alpha_drift", scan["drift"]), ("loss_spike", bool(spikes)),
                     ("excluded_duplicates", bool(frame.excluded)),
                     ("no_gain", vocab.GAIN not in available),
                     ("no_sensitivity",
                      not np.isfinite(sites["sensitivity"].to_numpy(dtype=float)).any()),
                     ("unclassified_sites", (sites.loc[classifiable, "site_class"] == "").any()),
                     ("failed_checkpoints", bool(results.read_failures(frame.run_dir)))):
        if on:
            flags.append(flag)
    return flags


def _bottleneck(frame: _Frame, loss: LossFit | None, sites: pd.DataFrame, kinds: dict,
                floor_doubtful: bool) -> dict:
    """fits.json's ``bottleneck``: the verdict, its reason, the kinds and the head counts."""
    available = set(frame.metric)
    verdict, reason = classify.decide(
        kinds, has_peaked_metric=bool(sites["peaked"].notna().any()),
        has_gain=vocab.GAIN in available, has_loss=loss is not None,
        has_entropy_criterion=vocab.PEAKED_ENTROPY in available, floor_doubtful=floor_doubtful)
    heads = sites[sites["site_kind"] == vocab.ATTN]
    cls = heads["site_class"]
    return {
        "verdict": verdict, "reason": reason, "share_min": vocab.GAIN_SHARE_MIN,
        "share_of": classify.SHARE_OF, "fdr": vocab.FDR, "kinds": kinds,
        "peaked_criteria": {name: classify.peaked_criteria(kind, available)
                            for name, kind in ((vocab.BOTTLENECK_ATTENTION, vocab.ATTN),
                                               (vocab.BOTTLENECK_LM_HEAD, vocab.LM_HEAD))},
        "n_heads": int(len(heads)),
        "n_peaked": int(heads["peaked"].fillna(False).astype(bool).sum()),
        "n_concentrating": int((cls == "concentrating").sum()),
        "n_saturated": int((cls == "saturated").sum()),
        "n_diffuse": int((cls == "diffuse").sum()),
        "n_share_significant": int((sites["q_share"] <= vocab.FDR).sum()),
        "top_sites": classify.top_sites(sites),
    }


def _document(frame: _Frame, config: FitConfig, loss: _LossStage, sites: pd.DataFrame,
              kinds: dict) -> dict:
    """fits.json (format in docs/architecture.md)."""
    t, steps, band = frame.t, frame.steps, config.band
    spikes = window.spikes(loss.series, steps, t, frame.revisions[frame.keep])
    scan = (window.loss_scan(t, loss.series, steps, loss.fit, n_boot=config.n_boot,
                             seed=config.seed, band=band)
            if loss.fit is not None else {"drift": False, "rows": []})
    flags = _flags(frame, loss.fit, scan, spikes, sites)
    doubtful = loss.fit is not None and (scan["drift"] or "L0_at_bound" in loss.fit.flags)
    return {
        "format": FITS_JSON_FORMAT,
        "band": [float(band[0]), float(band[1])],
        "ci_level": vocab.CI_LEVEL,
        "time_axis": frame.axis,
        "window": {"t_min": float(t[0]), "t_max": float(t[-1]), "step_min": int(steps[0]),
                   "step_max": int(steps[-1]), "n_points": len(t),
                   "start_rule": frame.win.start_rule},
        "excluded": frame.excluded,
        "spikes": spikes,
        "loss": loss_block(loss.fit, band),
        "loss_scan": scan,
        "skipped": frame.skipped,
        "bottleneck": _bottleneck(frame, loss.fit, sites, kinds, doubtful),
        "flags": flags,
    }
