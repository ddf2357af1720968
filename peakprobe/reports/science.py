"""The report's view of the 1/3 science: judged exponents, gain curves, window scan, peakedness, integrity.

Owns: reading (never computing) what ``fit`` wrote about the bottleneck question and laying it out
for summary.json and the page: every fitted exponent with its interval, window and three-way
verdict against the band (fits' own verdict when it wrote one, else ``fits.third.judge_third`` on
its interval: the same rule); the optimal-temperature gain G(t) of each softmax (LM head, all
attention, each layer, top heads) with its decay fit and its share of the reducible loss L − L0;
the alpha(t_min) window scan; both peakedness criteria; duplicated and spike-flagged checkpoints.
Anything the run did not measure comes back as ``measured: False``, never as invented numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from peakprobe.fits.third import judge_third
from peakprobe.reports.tables import Curve, RunData, fit_rows, series
from peakprobe.vocab import (
    ATTN,
    ATTN_ALL,
    ATTN_LAYER,
    BAND,
    BETA_EFF,
    BOTTLENECK_ATTENTION,
    BOTTLENECK_LM_HEAD,
    CI_LEVEL,
    GAIN,
    LM_HEAD,
    PEAKED_ENTROPY,
    PEAKED_FRACTION,
    THIRD,
    THIRD_VERDICTS,
    XSINK_SUFFIX,
    site_label,
)

TOP_GAIN_HEADS = 4  # attention heads of largest final gain listed and drawn
GAIN_KIND_ORDER = {LM_HEAD: 0, ATTN_ALL: 1, ATTN_LAYER: 2, ATTN: 3}


def _f(x: Any) -> float:
    """A float, NaN for None / missing / non-numbers."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def band_of(run: RunData) -> tuple[float, float]:
    """The equivalence band fit used (fits.json ``band``), else the default vocab.BAND."""
    band = run.verdicts.get("band")
    if isinstance(band, (list, tuple)) and len(band) == 2:
        return float(band[0]), float(band[1])
    return BAND


def ci_level_of(run: RunData) -> float:
    level = _f(run.verdicts.get("ci_level"))
    return level if math.isfinite(level) else CI_LEVEL


def judged(given: Any, lo: float, hi: float, band: tuple[float, float]) -> str:
    """fit's own three-way verdict when it wrote one, else the same rule on [lo, hi]."""
    if isinstance(given, str) and given in THIRD_VERDICTS:
        return given
    lo, hi = _f(lo), _f(hi)
    return judge_third(lo if math.isfinite(lo) else None, hi if math.isfinite(hi) else None, band)


def _decay(row: pd.Series) -> tuple[float, float, float, float]:
    """(alpha, lo, hi, c) of a gain fit as a *decay* exponent: G = c t^-alpha.

    A ``growth`` row (m = c t^alpha) of the gain is turned around (alpha -> -alpha)."""
    a, lo, hi, c = (_f(row[k]) for k in ("alpha", "alpha_lo", "alpha_hi", "c"))
    if str(row["fit"]) == "growth":
        return -a, -hi, -lo, c
    return a, lo, hi, c


def exponent_entry(row: pd.Series, quantity: str, band: tuple[float, float], **alpha) -> dict:
    """One judged exponent from a fits.parquet row (``alpha`` overrides alpha/alpha_lo/alpha_hi)."""
    a = alpha.get("alpha", _f(row["alpha"]))
    lo = alpha.get("alpha_lo", _f(row["alpha_lo"]))
    hi = alpha.get("alpha_hi", _f(row["alpha_hi"]))
    kind, layer, head = str(row["site_kind"]), int(row["layer"]), int(row["head"])
    return {
        "site_kind": kind,
        "layer": layer,
        "head": head,
        "label": site_label(kind, layer, head),
        "quantity": quantity,
        "fit": str(row["fit"]),
        "metric": str(row["metric"]),
        "alpha": a,
        "alpha_lo": lo,
        "alpha_hi": hi,
        "t_min": _f(row["t_min"]),
        "t_max": _f(row["t_max"]),
        "n_points": int(row["n_points"]) if pd.notna(row["n_points"]) else None,
        "verdict": judged(row.get("verdict"), lo, hi, band),
    }


def gain_sites(run: RunData) -> list[tuple[str, int, int]]:
    """The sites whose gain G is shown: LM head, all attention, every layer, top heads by final G."""
    r = run.results
    g = r[(r["metric"] == GAIN) & (r["revision"] == run.last_revision)]
    if g.empty:
        g = r[r["metric"] == GAIN].drop_duplicates(["site_kind", "layer", "head"], keep="last")
    keys = [(str(k), int(la), int(h)) for k, la, h in zip(g["site_kind"], g["layer"], g["head"], strict=True)]
    grouped = sorted((k for k in keys if k[0] != ATTN), key=lambda k: (GAIN_KIND_ORDER.get(k[0], 9), k[1], k[2]))
    heads = g[g["site_kind"] == ATTN].sort_values(["value", "layer", "head"], ascending=[False, True, True], kind="stable")
    top = [(ATTN, int(la), int(h)) for la, h in zip(heads["layer"], heads["head"], strict=True)][:TOP_GAIN_HEADS]
    return grouped + top


def gain_curve(run: RunData, kind: str, layer: int, head: int) -> Curve:
    """G(t) of one site, its fitted c t^-alpha over the window and a t^(-1/3) reference."""
    t, v = series(run, kind, layer, head, GAIN)
    rows = fit_rows(run, kind, layer, head, GAIN)
    row = rows.iloc[-1] if not rows.empty else None
    fit_t = fit_v = ref_v = np.empty(0)
    a = lo = hi = math.nan
    if row is not None:
        a, lo, hi, c = _decay(row)
        t0, t1 = _f(row["t_min"]), _f(row["t_max"])
        if all(map(math.isfinite, (a, c, t0, t1))) and 0 < t0 < t1:
            fit_t = np.geomspace(t0, t1, 64)  # (F,)
            fit_v = c * fit_t ** (-a)
            t_mid = math.sqrt(t0 * t1)
            ref_v = c * t_mid ** (-a) * (fit_t / t_mid) ** (-THIRD)
    return Curve(site_label(kind, layer, head), kind, layer, head, t, v, fit_t, fit_v, ref_v, a, lo, hi, math.nan)


def gains_block(run: RunData, band: tuple[float, float], loss_L0: float | None) -> dict:
    """summary.json ``gains``: per shown site its final G, share of L − L0 and decay exponent."""
    sites = gain_sites(run)
    if not sites:
        return {"measured": False, "sites": []}
    t_loss, loss = series(run, LM_HEAD, -1, -1, "loss")
    reducible = (loss[-1] - loss_L0) if loss.size and loss_L0 is not None else math.nan
    out = []
    for kind, layer, head in sites:
        t, g = series(run, kind, layer, head, GAIN)
        rows = fit_rows(run, kind, layer, head, GAIN)
        entry: dict[str, Any] = {
            "site_kind": kind,
            "layer": layer,
            "head": head,
            "label": site_label(kind, layer, head),
            "final_gain": float(g[-1]) if g.size else None,
            "share": float(g[-1] / reducible) if g.size and reducible > 0 else None,
            "alpha": None, "alpha_lo": None, "alpha_hi": None,
            "t_min": None, "t_max": None, "n_points": None,
            "verdict": None,
        }
        if not rows.empty:
            row = rows.iloc[-1]
            a, lo, hi, _ = _decay(row)
            e = exponent_entry(row, "gain G decay", band, alpha=a, alpha_lo=lo, alpha_hi=hi)
            entry.update({k: e[k] for k in ("alpha", "alpha_lo", "alpha_hi", "t_min", "t_max", "n_points", "verdict")})
        out.append(entry)
    return {"measured": True, "sites": out}


def exponents_block(run: RunData, band: tuple[float, float], loss: dict | None) -> list[dict]:
    """Every exponent the report states, judged: the loss law, each gain decay, the LM head's and
    the top sites' logit_std growth."""
    out = []
    if loss is not None and loss.get("alpha") is not None:
        out.append({
            "site_kind": LM_HEAD, "layer": -1, "head": -1, "label": "loss",
            "quantity": "loss L − L0 decay", "fit": "loss", "metric": "loss",
            **{k: loss.get(k) for k in ("alpha", "alpha_lo", "alpha_hi", "t_min", "t_max", "n_points")},
            "verdict": loss["verdict"],
        })
    for kind, layer, head in gain_sites(run):
        rows = fit_rows(run, kind, layer, head, GAIN)
        if not rows.empty:
            row = rows.iloc[-1]
            a, lo, hi, _ = _decay(row)
            out.append(exponent_entry(row, "gain G decay", band, alpha=a, alpha_lo=lo, alpha_hi=hi))
    growth_sites = [(LM_HEAD, -1, -1)]
    for s in (run.verdicts.get("bottleneck") or {}).get("top_sites") or []:
        growth_sites.append((str(s.get("site_kind")), int(s.get("layer", -1)), int(s.get("head", -1))))
    for kind, layer, head in dict.fromkeys(growth_sites):
        rows = fit_rows(run, kind, layer, head, "logit_std")
        rows = rows[rows["fit"] == "growth"]
        if not rows.empty:
            out.append(exponent_entry(rows.iloc[-1], "logit_std growth", band))
    return out


def window_scan_block(run: RunData, band: tuple[float, float]) -> dict:
    """summary.json ``window_scan``: fits.json's alpha(t_min) rows, each judged."""
    scan = run.verdicts.get("window_scan")
    if isinstance(scan, dict):
        quantity = str(scan.get("quantity") or scan.get("metric") or "loss")
        scan = scan.get("rows") or []
    else:
        quantity = "loss"
    if not isinstance(scan, list) or not scan:
        return {"measured": False, "rows": []}
    rows = []
    for r in scan:
        if not isinstance(r, dict):
            continue
        lo, hi = _f(r.get("alpha_lo")), _f(r.get("alpha_hi"))
        rows.append({
            "quantity": str(r.get("quantity") or r.get("metric") or quantity),
            "t_min": _f(r.get("t_min")),
            "t_max": _f(r.get("t_max")),
            "n_points": r.get("n_points"),
            "alpha": _f(r.get("alpha")),
            "alpha_lo": lo,
            "alpha_hi": hi,
            "verdict": judged(r.get("verdict"), lo, hi, band),
        })
    return {"measured": bool(rows), "rows": rows}


# (label, heads column) of each peakedness criterion the page lists
CRITERIA = (
    ("logit std > sqrt(2 ln n)", "final_peaked"),
    ("entropy-equivalent β_eff > sqrt(2 ln n)", f"final_{PEAKED_ENTROPY}"),
    ("logit std, sink key left out", "final_peaked" + XSINK_SUFFIX),
    ("entropy-equivalent, sink key left out", f"final_{PEAKED_ENTROPY}{XSINK_SUFFIX}"),
)


def peakedness_block(heads: pd.DataFrame) -> dict:
    """Both peakedness criteria at the last checkpoint, and whether any softmax is peaked at all.

    A site counts as peaked under a criterion when at least PEAKED_FRACTION of its rows are."""
    attn = heads[heads["site_kind"] == ATTN]
    lm = heads[heads["site_kind"] == LM_HEAD]
    criteria, any_measured, any_peaked = [], False, False
    for label, col in CRITERIA:
        a = attn[col].to_numpy(dtype=float)
        lm_v = float(lm[col].iloc[0]) if len(lm) and math.isfinite(lm[col].iloc[0]) else None
        measured = bool(np.isfinite(a).any()) or lm_v is not None
        if not measured and XSINK_SUFFIX in col:
            continue  # sink-excluded variants are listed only where measured
        n_peaked = int((a >= PEAKED_FRACTION).sum())
        any_measured |= measured
        any_peaked |= n_peaked > 0 or (lm_v is not None and lm_v >= PEAKED_FRACTION)
        criteria.append({
            "label": label, "column": col, "measured": measured,
            "n_attn": int(np.isfinite(a).sum()), "n_attn_peaked": n_peaked, "lm_head": lm_v,
        })
    lm_beta = float(lm[f"final_{BETA_EFF}"].iloc[0]) if len(lm) else math.nan
    if not any_measured:
        statement = "Peakedness was not measured in this run."
    elif any_peaked:
        statement = (
            f"A site counts as peaked when at least {PEAKED_FRACTION:.0%} of its rows are, at the "
            "last checkpoint; the 1/3 mechanism applies only to peaked softmaxes."
        )
    else:
        statement = (
            "At the last checkpoint no attention head and not the LM head is peaked under any "
            f"measured criterion (at least {PEAKED_FRACTION:.0%} of rows above sqrt(2 ln n)). "
            "The 1/3 mechanism — a softmax sharpening toward a peaked target — does not apply "
            "to this model, whatever the fitted exponents."
        )
    return {
        "measured": any_measured,
        "any_peaked": any_peaked if any_measured else None,
        "fraction": PEAKED_FRACTION,
        "statement": statement,
        "lm_head_beta_eff": lm_beta,
        "criteria": criteria,
    }


def _checkpoint_list(items: Any, steps: dict[str, int]) -> list[dict]:
    """Revisions from a list of strings or of dicts (revision, step, same_as / reason)."""
    out = []
    for it in items or []:
        if isinstance(it, dict):
            rev = str(it.get("revision") or it.get("rev") or "?")
            same = it.get("same_as") or it.get("duplicate_of") or it.get("kept")
            reason = it.get("reason") or it.get("metric") or it.get("flag")
            step = it.get("step", steps.get(rev))
        else:
            rev, same, reason, step = str(it), None, None, steps.get(str(it))
        out.append({
            "revision": rev,
            "step": int(step) if step is not None and pd.notna(step) else None,
            "same_as": str(same) if same else None,
            "reason": str(reason) if reason else None,
        })
    return sorted({d["revision"]: d for d in out}.values(), key=lambda d: (d["step"] is None, d["step"] or 0, d["revision"]))


def integrity_block(run: RunData) -> dict:
    """Duplicated checkpoints excluded from the fits (integrity.json, fits.json) and spike flags."""
    m = run.manifest
    steps = {str(c.get("revision")): c.get("step") for c in m.get("checkpoints") or []}
    dup_items: list = []
    integ = run.integrity or {}
    for key in ("duplicates", "excluded"):
        dup_items += list(integ.get(key) or [])
    for key in ("duplicates", "excluded_duplicates", "excluded"):
        dup_items += list(run.verdicts.get(key) or [])
    spikes = run.verdicts.get("spikes") or run.verdicts.get("spike_checkpoints") or []
    return {
        "integrity_checked": run.integrity is not None,
        "duplicates": _checkpoint_list(dup_items, steps),
        "spikes": _checkpoint_list(spikes, steps),
    }


def bottleneck_exponents(verdict: str | None, exponents: list[dict]) -> list[dict]:
    """The exponents behind a named bottleneck: its kind's gain decay and growth."""
    kinds = {BOTTLENECK_ATTENTION: (ATTN_ALL,), BOTTLENECK_LM_HEAD: (LM_HEAD,)}.get(verdict or "", ())
    return [
        {k: e[k] for k in ("label", "quantity", "alpha", "alpha_lo", "alpha_hi", "verdict")}
        for e in exponents
        if e["site_kind"] in kinds and e["metric"] != "loss"
    ]
