"""The frames a report draws, built from what ``fit`` and ``sweep`` wrote; no drawing here.

Owns: loading and checking a run directory for reporting (``load_run``), the per-site table
(``heads_table``, one row per softmax site, schema ``HEADS_SCHEMA``), the layer x head matrices of
the heatmaps, the curves of the log-log figures (data, fitted line, t^(1/3) reference) and the
sensitivity ranking. Nothing here fits or estimates anything: exponents, CIs and classes are
copied from ``fits.parquet`` / ``fits.json``; final metrics are the raw values of the last
checkpoint in ``checkpoints/*.parquet``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from peakprobe import vocab
from peakprobe.reports.roles import head_roles
from peakprobe.results import (
    FITS,
    FITS_JSON,
    FITS_SCHEMA,
    read_failures,
    read_fits,
    read_fits_json,
    read_integrity_record,
    read_manifest,
    read_results,
)
from peakprobe.vocab import (
    ATTN,
    BETA_EFF,
    FINAL_METRICS,
    GAIN,
    LM_EXTRA,
    LM_HEAD,
    PEAKED_ENTROPY,
    SENSITIVITY,
    THIRD,
    XSINK_SUFFIX,
    PeakprobeError,
    site_label,
)

# Metrics copied from the last checkpoint into the per-site table as ``final_<metric>``: the
# report's own choice (vocab.FINAL_METRICS), both peakedness criteria with their sink-excluded
# variants, and the LM head's next-token statistics.
PEAKEDNESS_METRICS: tuple[str, ...] = (
    "peaked",
    PEAKED_ENTROPY,
    BETA_EFF,
    "peaked" + XSINK_SUFFIX,
    PEAKED_ENTROPY + XSINK_SUFFIX,
    BETA_EFF + XSINK_SUFFIX,
)
TABLE_METRICS: tuple[str, ...] = tuple(
    dict.fromkeys((*FINAL_METRICS, *PEAKEDNESS_METRICS, vocab.ENTROPY_NORM, *LM_EXTRA, GAIN))
)

HEADS_SCHEMA = pa.schema(
    [
        ("site_kind", pa.string()),
        ("layer", pa.int64()),
        ("head", pa.int64()),
        ("site_class", pa.string()),
        ("time_axis", pa.string()),
        ("alpha", pa.float64()),
        ("alpha_lo", pa.float64()),
        ("alpha_hi", pa.float64()),
        ("c", pa.float64()),
        ("r2", pa.float64()),
        ("n_points", pa.int64()),
        ("t_min", pa.float64()),
        ("t_max", pa.float64()),
        ("monotone", pa.bool_()),
        ("flags", pa.string()),
        ("first_logit_std", pa.float64()),
        ("verdict", pa.string()),
        ("alpha_late", pa.float64()),
        ("alpha_late_lo", pa.float64()),
        ("alpha_late_hi", pa.float64()),
        ("q_growing", pa.float64()),
        ("peaked", pa.bool_()),
        ("gain_alpha", pa.float64()),
        ("gain_alpha_lo", pa.float64()),
        ("gain_alpha_hi", pa.float64()),
        ("gain_verdict", pa.string()),
        ("share", pa.float64()),
        ("share_lo", pa.float64()),
        ("share_hi", pa.float64()),
        ("q_share", pa.float64()),
        *[(f"final_{m}", pa.float64()) for m in TABLE_METRICS],
        ("sensitivity", pa.float64()),
        ("role", pa.string()),
        ("role_score", pa.float64()),
        ("role_step", pa.int64()),
    ]
)
HEADS_COLUMNS = tuple(HEADS_SCHEMA.names)
SITE_KEYS = ["site_kind", "layer", "head"]


class ReportError(PeakprobeError):
    """A run directory cannot be reported on (missing fits, malformed files)."""


@dataclass
class RunData:
    """Everything a report reads from one run directory."""

    run_dir: Path
    manifest: dict
    results: pd.DataFrame  # tidy, every finished checkpoint
    fits: pd.DataFrame  # fits.parquet
    verdicts: dict  # fits.json
    failures: list[dict]
    integrity: dict | None  # integrity.json (duplicated checkpoints), None when absent
    excluded: frozenset[str]  # revisions the fits left out (duplicated weights): not drawn
    time_axis: str  # 'tau' or 'step'
    last_revision: str
    last_step: int
    series_index: dict | None = None  # metric -> its kept rows, filled on first use


@dataclass
class Curve:
    """One log-log panel: the measured points, the fitted law over its window and a 1/3 reference."""

    label: str
    site_kind: str
    layer: int
    head: int
    t: np.ndarray  # (P,) time of each checkpoint with t > 0
    value: np.ndarray  # (P,) measured metric
    fit_t: np.ndarray  # (F,) grid over the fitted window (empty without a fit)
    fit_value: np.ndarray  # (F,) c t^alpha (growth) or L0 + c t^-alpha (loss)
    ref_value: (
        np.ndarray
    )  # (F,) the same law with exponent 1/3, equal to the fit at the window's geometric middle
    alpha: float
    alpha_lo: float
    alpha_hi: float
    L0: float  # NaN for growth curves


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Read manifest, results, fits.parquet and fits.json of a run, checking what a report needs."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    results = read_results(run_dir)
    fits_path = run_dir / FITS
    json_path = run_dir / FITS_JSON
    if not fits_path.exists() or not json_path.exists():
        raise ReportError(
            f"{run_dir} has no {FITS} / {FITS_JSON}; run `peakprobe fit {run_dir}` before reporting"
        )
    fits = read_fits(run_dir)
    missing = [c for c in FITS_SCHEMA.names if c not in fits.columns]
    if missing:
        raise ReportError(
            f"{fits_path} lacks columns {', '.join(missing)}; re-run `peakprobe fit {run_dir}`"
        )
    verdicts = read_fits_json(run_dir)
    time_axis = str(verdicts.get("time_axis") or "")
    if time_axis not in ("tau", "step"):
        axes = sorted(set(fits["time_axis"].dropna().astype(str)) & {"tau", "step"})
        time_axis = axes[0] if axes else "step"
    integrity = read_integrity_record(run_dir)
    excluded = {str(e.get("revision")) for e in verdicts.get("excluded") or [] if isinstance(e, dict)}
    excluded |= set((integrity or {}).get("flagged") or {})
    kept = results[~results["revision"].isin(excluded)]
    last = (kept if not kept.empty else results).iloc[-1]  # read_results sorts by step
    return RunData(
        run_dir=run_dir,
        manifest=manifest,
        results=results,
        fits=fits,
        verdicts=verdicts,
        failures=read_failures(run_dir),
        integrity=integrity,
        excluded=frozenset(excluded),
        time_axis=time_axis,
        last_revision=str(last["revision"]),
        last_step=int(last["step"]),
    )


def _final_metrics(run: RunData) -> pd.DataFrame:
    """(site) x metric values at the last checkpoint, one row per site."""
    res = run.results
    final = res[(res["revision"] == run.last_revision) & res["site_kind"].isin(vocab.CLASSIFIED_KINDS)]
    wide = final.pivot_table(index=SITE_KEYS, columns="metric", values="value", aggfunc="first")
    return wide


def heads_table(run: RunData) -> pd.DataFrame:
    """One row per site (attention heads, the LM head, MoE routers), columns ``HEADS_COLUMNS``.

    Fit columns come from the site's ``growth`` fit of ``logit_std`` in fits.parquet; ``final_*``
    columns from the last checkpoint; ``sensitivity`` from the last checkpoint's ``sensitivity``
    metric, else from fits.parquet. Sites without a fit keep NaN exponents and ``n_points`` -1.
    """
    fits = run.fits
    growth = fits[
        (fits["fit"] == vocab.FIT_GROWTH)
        & (fits["metric"] == vocab.LOGIT_STD)
        & fits["site_kind"].isin(vocab.CLASSIFIED_KINDS)
    ]
    growth = growth.drop_duplicates(SITE_KEYS, keep="last").set_index(SITE_KEYS)
    final = _final_metrics(run)
    index = final.index.union(growth.index).sort_values()
    out = pd.DataFrame(index=index)
    for col in ("alpha", "alpha_lo", "alpha_hi", "c", "r2", "t_min", "t_max"):
        out[col] = growth[col].reindex(index).astype("float64")
    out["site_class"] = growth["site_class"].reindex(index).fillna("").astype(str)
    axis = growth["time_axis"].reindex(index).fillna("").astype(str)
    out["time_axis"] = axis.where(axis != "", run.time_axis)
    out["n_points"] = growth["n_points"].reindex(index).fillna(-1).astype("int64")
    out["monotone"] = growth["monotone"].reindex(index).fillna(False).astype(bool)
    out["flags"] = growth["flags"].reindex(index).fillna("").astype(str)
    out["first_logit_std"] = growth["first_value"].reindex(index).astype("float64")
    out["verdict"] = _column(growth, "verdict", index, "").astype(str)
    for col in ("alpha_late", "alpha_late_lo", "alpha_late_hi", "q_growing"):
        out[col] = _column(growth, col, index, np.nan).astype("float64")
    out["peaked"] = _column(growth, "peaked", index, False).fillna(False).astype(bool)
    gain = fits[(fits["fit"] == vocab.FIT_GAIN) & fits["site_kind"].isin(vocab.CLASSIFIED_KINDS)]
    gain = gain.drop_duplicates(SITE_KEYS, keep="last").set_index(SITE_KEYS)
    for col in ("alpha", "alpha_lo", "alpha_hi", "verdict"):
        out[f"gain_{col}"] = _column(gain, col, index, "" if col == "verdict" else np.nan)
    out["gain_verdict"] = out["gain_verdict"].fillna("").astype(str)
    for col in ("share", "share_lo", "share_hi", "q_share"):
        out[col] = _column(gain, col, index, np.nan).astype("float64")
    for metric in TABLE_METRICS:
        if metric in final.columns:
            out[f"final_{metric}"] = final[metric].reindex(index).astype("float64")
        else:
            out[f"final_{metric}"] = np.nan
    sens = pd.Series(np.nan, index=index, dtype="float64")
    if SENSITIVITY in final.columns:
        sens = final[SENSITIVITY].reindex(index).astype("float64")
    sens = sens.fillna(growth["sensitivity"].reindex(index).astype("float64"))
    out["sensitivity"] = sens
    roles = head_roles(run.results).set_index(SITE_KEYS)
    out["role"] = _column(roles, "role", index, "").astype(str)
    out["role_score"] = _column(roles, "role_score", index, np.nan).astype("float64")
    out["role_step"] = _column(roles, "role_step", index, -1).astype("int64")
    out = out.reset_index()
    out["layer"] = out["layer"].astype("int64")
    out["head"] = out["head"].astype("int64")
    return out[list(HEADS_COLUMNS)].reset_index(drop=True)


def _column(frame: pd.DataFrame, col: str, index: pd.Index, default: object) -> pd.Series:
    """``frame[col]`` on ``index`` (``default`` where a site has no row or the column is absent,
    as in fits written by an older peakprobe)."""
    if col not in frame.columns:
        return pd.Series(default, index=index)
    values = frame[col].reindex(index)
    return values if default is np.nan else values.where(values.notna(), default)


def attn_shape(heads: pd.DataFrame) -> tuple[int, int]:
    """(n_layers, n_heads) spanned by the attention sites (0, 0 when there are none)."""
    attn = heads[heads["site_kind"] == ATTN]
    if attn.empty:
        return 0, 0
    return int(attn["layer"].max()) + 1, int(attn["head"].max()) + 1


def site_matrix(heads: pd.DataFrame, column: str) -> np.ndarray:
    """(n_layers, n_heads) matrix of ``column`` over the attention sites; NaN where no site."""
    n_layers, n_heads = attn_shape(heads)
    mat = np.full((n_layers, n_heads), np.nan)  # (L, H)
    attn = heads[heads["site_kind"] == ATTN]
    mat[attn["layer"].to_numpy(), attn["head"].to_numpy()] = attn[column].to_numpy(dtype="float64")
    return mat


def fit_rows(run: RunData, site_kind: str, layer: int, head: int, metric: str) -> pd.DataFrame:
    """Every fits.parquet row of one site's metric (any ``fit`` kind)."""
    f = run.fits
    return f[
        (f["site_kind"] == site_kind)
        & (f["layer"] == layer)
        & (f["head"] == head)
        & (f["metric"] == metric)
    ]


def _site_fit(
    run: RunData, fit: str, site_kind: str, layer: int, head: int, metric: str
) -> pd.Series | None:
    rows = fit_rows(run, site_kind, layer, head, metric)
    rows = rows[rows["fit"] == fit]
    return None if rows.empty else rows.iloc[-1]


def series(
    run: RunData, site_kind: str, layer: int, head: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """(t, value) of one site's metric over the checkpoints with t > 0 that the fits kept
    (duplicated checkpoints left out), in time order."""
    if run.series_index is None:
        run.series_index = {}
    if metric not in run.series_index:  # one scan of every row per metric, not per curve
        r = run.results
        run.series_index[metric] = r[(r["metric"] == metric) & ~r["revision"].isin(run.excluded)]
    m = run.series_index[metric]
    rows = m[(m["site_kind"] == site_kind) & (m["layer"] == layer) & (m["head"] == head)]
    t = rows[run.time_axis].to_numpy(dtype="float64")
    v = rows["value"].to_numpy(dtype="float64")
    keep = np.isfinite(t) & (t > 0) & np.isfinite(v)
    order = np.argsort(t[keep], kind="stable")
    return t[keep][order], v[keep][order]


def _window(row: pd.Series, n: int = 64) -> np.ndarray:
    t_min, t_max = float(row["t_min"]), float(row["t_max"])
    if not (np.isfinite(t_min) and np.isfinite(t_max)) or t_min <= 0 or t_max < t_min:
        return np.empty(0)
    return np.geomspace(t_min, t_max, n)


def _f(row: pd.Series | None, key: str) -> float:
    if row is None:
        return math.nan
    v = row[key]
    return math.nan if v is None or pd.isna(v) else float(v)


def growth_curve(
    run: RunData, site_kind: str, layer: int, head: int, metric: str = vocab.LOGIT_STD
) -> Curve:
    """logit_std (or ``metric``) of one site against time, its fitted c t^alpha and a t^(1/3) line."""
    t, v = series(run, site_kind, layer, head, metric)
    row = _site_fit(run, "growth", site_kind, layer, head, metric)
    fit_t = _window(row) if row is not None else np.empty(0)
    alpha, c = _f(row, "alpha"), _f(row, "c")
    if fit_t.size and np.isfinite(alpha) and np.isfinite(c):
        fit_v = c * fit_t**alpha  # (F,)
        t_mid = math.sqrt(fit_t[0] * fit_t[-1])
        ref_v = c * t_mid**alpha * (fit_t / t_mid) ** THIRD  # (F,)
    else:
        fit_t = fit_v = ref_v = np.empty(0)
    return Curve(
        site_label(site_kind, layer, head),
        site_kind,
        layer,
        head,
        t,
        v,
        fit_t,
        fit_v,
        ref_v,
        alpha,
        _f(row, "alpha_lo"),
        _f(row, "alpha_hi"),
        math.nan,
    )


def loss_curve(run: RunData) -> Curve | None:
    """The LM loss against time with its fit L0 + c t^-alpha and the L0 + c' t^(-1/3) reference."""
    t, v = series(run, LM_HEAD, -1, -1, "loss")
    if t.size == 0:
        return None
    row = _site_fit(run, "loss", LM_HEAD, -1, -1, "loss")
    fit_t = _window(row) if row is not None else np.empty(0)
    alpha, c, L0 = _f(row, "alpha"), _f(row, "c"), _f(row, "L0")
    base = L0 if np.isfinite(L0) else 0.0
    if fit_t.size and np.isfinite(alpha) and np.isfinite(c):
        fit_v = base + c * fit_t ** (-alpha)  # (F,)
        t_mid = math.sqrt(fit_t[0] * fit_t[-1])
        c_ref = c * t_mid ** (-alpha) * t_mid**THIRD
        ref_v = base + c_ref * fit_t ** (-THIRD)  # (F,)
    else:
        fit_t = fit_v = ref_v = np.empty(0)
    return Curve(
        "loss",
        LM_HEAD,
        -1,
        -1,
        t,
        v,
        fit_t,
        fit_v,
        ref_v,
        alpha,
        _f(row, "alpha_lo"),
        _f(row, "alpha_hi"),
        L0,
    )


def curve_sites(
    run: RunData, heads: pd.DataFrame, k: int = 6
) -> tuple[list[tuple[str, int, int]], str]:
    """The attention sites whose growth curves are drawn, and how they were chosen.

    The first choice is fits.json's ``bottleneck.top_sites`` (attention entries), then the other
    ``concentrating`` heads by decreasing alpha, up to ``k``; with no concentrating head at all,
    the ``k`` heads of largest alpha. The LM head is drawn separately and is not in this list.
    """
    attn = heads[heads["site_kind"] == ATTN]
    present = set(zip(attn["layer"], attn["head"], strict=True))
    chosen: list[tuple[str, int, int]] = []
    top = (run.verdicts.get("bottleneck") or {}).get("top_sites") or []
    for site in top:
        key = (int(site.get("layer", -1)), int(site.get("head", -1)))
        if site.get("site_kind") == ATTN and key in present and (ATTN, *key) not in chosen:
            chosen.append((ATTN, *key))
    conc = attn[attn["site_class"] == "concentrating"].sort_values(
        ["alpha", "layer", "head"], ascending=[False, True, True], kind="stable"
    )
    for layer, head in zip(conc["layer"], conc["head"], strict=True):
        if len(chosen) >= k:
            break
        if (ATTN, int(layer), int(head)) not in chosen:
            chosen.append((ATTN, int(layer), int(head)))
    chosen = chosen[:k]
    if chosen:
        return chosen, "top concentrating heads (fits.json top sites first, then by alpha)"
    ranked = attn[np.isfinite(attn["alpha"])].sort_values(
        ["alpha", "layer", "head"], ascending=[False, True, True], kind="stable"
    )
    chosen = [(ATTN, int(r.layer), int(r.head)) for r in ranked.head(k).itertuples()]
    return chosen, "no head is classed concentrating; heads of largest alpha"


def logit_max_series(run: RunData) -> pd.DataFrame:
    """The largest logit of each layer (max over its heads; layer -1 the LM head) at every
    checkpoint: columns layer, step, t (the run's time axis), value; empty when the run has no
    ``logit_max``."""
    res = run.results
    rows = res[(res["metric"] == vocab.LOGIT_MAX) & res["site_kind"].isin((ATTN, LM_HEAD))]
    if rows.empty:
        return pd.DataFrame(columns=["layer", "step", "t", "value"])
    out = rows.groupby(["layer", "step"], as_index=False).agg(value=("value", "max"),
                                                              tau=("tau", "first"))
    out["t"] = out["tau"] if run.time_axis == "tau" else out["step"].astype(float)
    return out[["layer", "step", "t", "value"]].sort_values(["layer", "step"], kind="stable")


def sensitivity_ranking(heads: pd.DataFrame) -> pd.DataFrame:
    """Sites with a measured sensitivity, most negative d loss / d log beta first (empty if none)."""
    measured = heads[np.isfinite(heads["sensitivity"])]
    return measured.sort_values(
        ["sensitivity", "site_kind", "layer", "head"], kind="stable"
    ).reset_index(drop=True)
