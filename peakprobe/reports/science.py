"""The report's view of the 1/3 science: judged exponents, gain curves, window scan, peakedness, integrity.

Owns: reading (never computing) what ``fit`` wrote about the bottleneck question and laying it out
for summary.json and the page: every fitted exponent with its interval, window and three-way
verdict against the band (fits' own verdict when it wrote one, else ``fits.third.judge_third`` on
its interval: the same rule); the optimal-temperature gain G(t) of each softmax (LM head, all
attention, each layer, top heads) with its decay fit and its share of the loss decrease;
the alpha(t_min) window scan; both peakedness criteria; duplicated and spike-flagged checkpoints.
Anything the run did not measure comes back as ``measured: False``, never as invented numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from peakprobe import vocab
from peakprobe.fits.third import judge_third
from peakprobe.reports.tables import Curve, RunData, fit_rows, series
from peakprobe.vocab import (
    ATTN,
    ATTN_ALL,
    ATTN_LAYER,
    BAND,
    BETA_EFF,
    BOTTLENECK_ATTENTION,
    BOTTLENECK_NONE,
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


def _gain_fits(run: RunData) -> pd.DataFrame:
    f = run.fits
    return f[(f["fit"] == vocab.FIT_GAIN) | ((f["metric"] == GAIN) & (f["fit"] == vocab.FIT_GROWTH))]


def gain_sites(run: RunData) -> list[tuple[str, int, int]]:
    """The sites whose gain G is shown: the LM head, all attention, every layer group, then the
    TOP_GAIN_HEADS heads of largest fitted share (largest final G when no share was fitted)."""
    r = run.results
    g = r[r["metric"] == GAIN].drop_duplicates(["site_kind", "layer", "head"], keep="last")
    if g.empty:
        return []
    keys = [(str(k), int(la), int(h)) for k, la, h in zip(g["site_kind"], g["layer"], g["head"], strict=True)]
    grouped = sorted((k for k in keys if k[0] != ATTN), key=lambda k: (GAIN_KIND_ORDER.get(k[0], 9), k[1], k[2]))
    heads = g[g["site_kind"] == ATTN][["layer", "head", "value"]].copy()
    fits = _gain_fits(run)
    fits = fits[fits["site_kind"] == ATTN]
    if "share" in fits and np.isfinite(fits["share"].to_numpy(dtype=float)).any():
        heads = heads.merge(fits[["layer", "head", "share"]], on=["layer", "head"], how="left")
        heads["value"] = heads["share"].fillna(-np.inf)
    heads = heads.sort_values(["value", "layer", "head"], ascending=[False, True, True], kind="stable")
    top = [(ATTN, int(la), int(h)) for la, h in zip(heads["layer"], heads["head"], strict=True)]
    return grouped + top[:TOP_GAIN_HEADS]


def gain_metric(run: RunData, kind: str) -> str:
    """The gain series a site's fit and share read: the LM head's ``gain_after_attention``
    where the run measured it, else ``gain``."""
    if kind == LM_HEAD and (run.results["metric"] == vocab.GAIN_AFTER_ATTENTION).any():
        return vocab.GAIN_AFTER_ATTENTION
    return GAIN


def _gain_label(run: RunData, kind: str, layer: int, head: int) -> str:
    after = gain_metric(run, kind) == vocab.GAIN_AFTER_ATTENTION
    return site_label(kind, layer, head) + (" after attention" if after else "")


def _gain_row(run: RunData, kind: str, layer: int, head: int) -> pd.Series | None:
    rows = fit_rows(run, kind, layer, head, gain_metric(run, kind))
    rows = rows[rows["fit"].isin(("gain", "growth"))]
    return rows.iloc[-1] if not rows.empty else None


def gain_curve(run: RunData, kind: str, layer: int, head: int) -> Curve:
    """G(t) of one site, its fitted c t^-alpha over the window and a t^(-1/3) reference."""
    t, v = series(run, kind, layer, head, gain_metric(run, kind))
    row = _gain_row(run, kind, layer, head)
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
    return Curve(_gain_label(run, kind, layer, head), kind, layer, head, t, v, fit_t, fit_v, ref_v,
                 a, lo, hi, math.nan)


def _gain_exponent(row: pd.Series, band: tuple[float, float]) -> dict:
    a, lo, hi, _ = _decay(row)
    e = exponent_entry(row, "gain G decay", band, alpha=a, alpha_lo=lo, alpha_hi=hi)
    for k in ("share", "share_lo", "share_hi", "q_share"):
        e[k] = _f(row[k]) if k in row else math.nan
    return e


def gains_block(run: RunData, band: tuple[float, float]) -> dict:
    """summary.json ``gains``: per shown site its final G, fitted share of the loss decrease with its
    interval (fits.parquet), and the decay exponent with its window and verdict."""
    sites = gain_sites(run)
    if not sites:
        return {"measured": False, "sites": []}
    out = []
    for kind, layer, head in sites:
        _, g = series(run, kind, layer, head, gain_metric(run, kind))
        row = _gain_row(run, kind, layer, head)
        entry: dict[str, Any] = {
            "site_kind": kind, "layer": layer, "head": head,
            "label": _gain_label(run, kind, layer, head),
            "final_gain": float(g[-1]) if g.size else None,
        }
        keys = ("alpha", "alpha_lo", "alpha_hi", "t_min", "t_max", "n_points", "verdict",
                "share", "share_lo", "share_hi", "q_share")
        if row is None:
            entry.update(dict.fromkeys(keys))
        else:
            e = _gain_exponent(row, band)
            entry.update({k: e[k] for k in keys})
        out.append(entry)
    return {"measured": True, "sites": out}


def _kind_growth(run: RunData, band: tuple[float, float]) -> list[dict]:
    """fits.json's per-kind logit_std growth exponents (the LM head's; attention's mean over its
    peaked heads), judged, over the fit window."""
    b = run.verdicts.get("bottleneck") or {}
    window = run.verdicts.get("window") or {}
    out = []
    for kind, k in (b.get("kinds") or {}).items():
        if not isinstance(k, dict) or k.get("alpha_growth") is None:
            continue
        site = (ATTN_ALL, -1, -1) if kind == BOTTLENECK_ATTENTION else (LM_HEAD, -1, -1)
        lo, hi = _f(k.get("alpha_growth_lo")), _f(k.get("alpha_growth_hi"))
        out.append({
            "site_kind": site[0], "layer": -1, "head": -1,
            "label": "attention" if kind == BOTTLENECK_ATTENTION else site_label(*site),
            "quantity": f"logit_std growth ({k['growth_of']})" if k.get("growth_of") else "logit_std growth",
            "fit": vocab.FIT_GROWTH, "metric": vocab.LOGIT_STD,
            "alpha": _f(k.get("alpha_growth")), "alpha_lo": lo, "alpha_hi": hi,
            "t_min": _f(window.get("t_min")), "t_max": _f(window.get("t_max")),
            "n_points": window.get("n_points"),
            "verdict": judged(k.get("growth_verdict"), lo, hi, band),
        })
    return out


def exponents_block(run: RunData, band: tuple[float, float], loss: dict | None) -> list[dict]:
    """Every exponent the report states, judged: the loss law, each shown gain's decay, each
    kind's logit_std growth, the LM head's and the top sites' logit_std growth."""
    out = []
    if loss is not None and loss.get("alpha") is not None:
        out.append({
            "site_kind": LM_HEAD, "layer": -1, "head": -1, "label": "loss",
            "quantity": "loss L − L0 decay", "fit": "loss", "metric": "loss",
            **{k: loss.get(k) for k in ("alpha", "alpha_lo", "alpha_hi", "t_min", "t_max", "n_points")},
            "verdict": loss["verdict"],
        })
    for site in gain_sites(run):
        row = _gain_row(run, *site)
        if row is not None:
            out.append(_gain_exponent(row, band))
    out += _kind_growth(run, band)
    growth_sites = [(LM_HEAD, -1, -1)]
    for s in (run.verdicts.get("bottleneck") or {}).get("top_sites") or []:
        if s.get("site_kind") == ATTN:
            growth_sites.append((ATTN, int(s.get("layer", -1)), int(s.get("head", -1))))
    for kind, layer, head in list(dict.fromkeys(growth_sites))[: 1 + TOP_GAIN_HEADS]:
        rows = fit_rows(run, kind, layer, head, vocab.LOGIT_STD)
        rows = rows[rows["fit"] == vocab.FIT_GROWTH]
        if not rows.empty:
            out.append(exponent_entry(rows.iloc[-1], "logit_std growth", band))
    seen: set[tuple] = set()
    unique = []
    for e in out:  # the LM head's growth is both a kind's and a site's exponent: list it once
        key = (e["site_kind"], e["layer"], e["head"], e["fit"], e["metric"])
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return unique


def window_scan_block(run: RunData, band: tuple[float, float]) -> dict:
    """summary.json ``window_scan``: fits.json's ``loss_scan`` (the loss exponent refitted with the
    window starting at later checkpoints), each row judged; ``drift`` as fit decided it."""
    scan = run.verdicts.get("loss_scan")
    rows_in = scan.get("rows") if isinstance(scan, dict) else None
    if not isinstance(rows_in, list) or not rows_in:
        return {"measured": False, "drift": None, "rows": []}
    t_max = _f((run.verdicts.get("window") or {}).get("t_max"))
    rows = []
    for r in rows_in:
        if not isinstance(r, dict):
            continue
        lo, hi = _f(r.get("alpha_lo")), _f(r.get("alpha_hi"))
        rows.append({
            "quantity": "loss",
            "t_min": _f(r.get("t_min")),
            "step_min": r.get("step_min"),
            "t_max": _f(r.get("t_max", t_max)),
            "n_points": r.get("n_points"),
            "alpha": _f(r.get("alpha")),
            "alpha_lo": lo,
            "alpha_hi": hi,
            "verdict": judged(r.get("verdict"), lo, hi, band),
        })
    drift = scan.get("drift")
    return {"measured": bool(rows), "drift": bool(drift) if isinstance(drift, bool) else None, "rows": rows}


# (label, heads column) of each peakedness criterion the page lists
# the entropy-equivalent rule first: it is the headline (the bottleneck verdict's)
CRITERIA = (
    ("entropy-equivalent β_eff > sqrt(2 ln n)", f"final_{PEAKED_ENTROPY}"),
    ("logit std > sqrt(2 ln n)", "final_peaked"),
    ("entropy-equivalent, sink key left out", f"final_{PEAKED_ENTROPY}{XSINK_SUFFIX}"),
    ("logit std, sink key left out", "final_peaked" + XSINK_SUFFIX),
)


def _any_peaked(b: dict, from_table: bool | None) -> bool | None:
    """Whether any softmax is peaked: fit's answer (verdict ``none``, or its kinds' ``peaked``)
    where fits.json has one, else the table's."""
    kinds = {k: v for k, v in (b.get("kinds") or {}).items() if isinstance(v, dict)}
    if b.get("verdict") == BOTTLENECK_NONE:
        return False
    if any(isinstance(v.get("peaked"), bool) for v in kinds.values()):
        return any(v.get("peaked") is True for v in kinds.values())
    return from_table


def _peakedness_statement(any_peaked: bool | None, absence_shown: bool) -> str:
    """The digest's sentence on peakedness (``absence_shown``: the entropy criterion was
    measured, or fit found no softmax peaked)."""
    rule = f"at least {PEAKED_FRACTION:.0%} of its rows lie above sqrt(2 ln n), n = its options"
    if any_peaked is None:
        return "Peakedness was not measured in this run."
    if any_peaked:
        return (f"A softmax counts as peaked at the last checkpoint when {rule}. The 1/3 mechanism "
                "applies only to peaked softmaxes.")
    if absence_shown:
        return (f"At the last checkpoint no attention head and not the LM head is peaked ({rule}, "
                "under either criterion). The 1/3 mechanism — a softmax sharpening toward a peaked "
                "target — does not apply to this model, whatever the fitted exponents say.")
    return (f"At the last checkpoint no softmax is peaked by its logit std ({rule}), but the "
            "entropy-equivalent criterion was not measured: a near-deterministic softmax can keep "
            "a low logit std, so this run cannot show that the 1/3 mechanism is absent.")


def peakedness_block(run: RunData, heads: pd.DataFrame) -> dict:
    """Both peakedness criteria at the last checkpoint, and whether any softmax is peaked at all.

    A site counts as peaked under a criterion when at least PEAKED_FRACTION of its rows are. The
    answer to "is any softmax peaked" is fit's (bottleneck verdict ``none``, or its kinds'
    ``peaked``) when fits.json has it, else read off the table with the same rule."""
    attn = heads[heads["site_kind"] == ATTN]
    lm = heads[heads["site_kind"] == LM_HEAD]
    criteria, any_measured, table_peaked = [], False, False
    for label, col in CRITERIA:
        a = attn[col].to_numpy(dtype=float)
        lm_v = float(lm[col].iloc[0]) if len(lm) and math.isfinite(lm[col].iloc[0]) else None
        measured = bool(np.isfinite(a).any()) or lm_v is not None
        if not measured and XSINK_SUFFIX in col:
            continue  # sink-excluded variants are listed only where measured
        n_peaked = int((a >= PEAKED_FRACTION).sum())
        any_measured |= measured
        table_peaked |= n_peaked > 0 or (lm_v is not None and lm_v >= PEAKED_FRACTION)
        criteria.append({
            "label": label, "metric": col.removeprefix("final_"), "measured": measured,
            "n_attn": int(np.isfinite(a).sum()), "n_attn_peaked": n_peaked, "lm_head": lm_v,
        })
    b = run.verdicts.get("bottleneck") or {}
    any_peaked = _any_peaked(b, table_peaked if any_measured else None)
    used = {str(k): [str(x) for x in v] for k, v in (b.get("peaked_criteria") or {}).items()}
    entropy_measured = any(c["measured"] for c in criteria if c["metric"] == PEAKED_ENTROPY)
    statement = _peakedness_statement(any_peaked, entropy_measured or b.get("verdict") == BOTTLENECK_NONE)
    return {
        "measured": any_measured,
        "any_peaked": any_peaked,
        "fraction": PEAKED_FRACTION,
        "statement": statement,
        "criteria_used": used,
        "lm_head_beta_eff": float(lm[f"final_{BETA_EFF}"].iloc[0]) if len(lm) else None,
        "criteria": criteria,
    }


def _step(steps: dict[str, Any], rev: str, given: Any) -> int | None:
    step = given if given is not None else steps.get(rev)
    return int(step) if step is not None and pd.notna(step) else None


def integrity_block(run: RunData) -> dict:
    """Duplicated checkpoints (integrity.json ``flagged``; fits.json ``excluded``) and the
    checkpoints fit flagged as loss spikes (fits.json ``spikes``)."""
    steps = {str(c.get("revision")): c.get("step") for c in run.manifest.get("checkpoints") or []}
    integ = run.integrity
    flagged = dict((integ or {}).get("flagged") or {})
    excluded = {
        str(e.get("revision")): e for e in run.verdicts.get("excluded") or [] if isinstance(e, dict)
    }
    dups = []
    for rev in set(flagged) | set(excluded):
        f, e = flagged.get(rev) or {}, excluded.get(rev) or {}
        dups.append({
            "revision": rev,
            "step": _step(steps, rev, f.get("step", e.get("step"))),
            "same_as": [str(x) for x in (f.get("duplicates") or e.get("duplicates") or [])],
            "files": [str(x) for x in f.get("files") or []],
            "whole": next((w for w in (f.get("whole"), e.get("whole")) if isinstance(w, bool)), None),
            "excluded": rev in excluded,
            "reason": str(e.get("reason")) if e.get("reason") else None,
        })
    spikes = []
    for sp in run.verdicts.get("spikes") or []:
        if isinstance(sp, dict):
            rev = str(sp.get("revision"))
            spikes.append({
                "revision": rev,
                "step": _step(steps, rev, sp.get("step")),
                "loss": _f(sp.get("loss")),
                "jump": _f(sp.get("jump")),
            })
    order = lambda d: (d["step"] is None, d["step"] or 0, d["revision"])  # noqa: E731
    return {
        "integrity_checked": integ is not None,
        "n_unchecked": len((integ or {}).get("unchecked") or []),
        "duplicates": sorted(dups, key=order),
        "spikes": sorted(spikes, key=order),
    }


def bottleneck_kinds(run: RunData, band: tuple[float, float]) -> list[dict]:
    """fits.json's per-kind evidence (attention, LM head): peaked, share of the loss decrease with its
    interval and BH q-value, gain decay and logit growth exponents with their verdicts."""
    out = []
    for kind, k in ((run.verdicts.get("bottleneck") or {}).get("kinds") or {}).items():
        if not isinstance(k, dict):
            continue
        g_lo, g_hi = _f(k.get("alpha_gain_lo")), _f(k.get("alpha_gain_hi"))
        w_lo, w_hi = _f(k.get("alpha_growth_lo")), _f(k.get("alpha_growth_hi"))
        out.append({
            "kind": str(kind),
            "label": "attention" if kind == BOTTLENECK_ATTENTION else "LM head",
            "site": k.get("site"),
            "peaked": k.get("peaked"),
            "n_sites": k.get("n_sites"),
            "n_peaked": k.get("n_peaked"),
            "share": _f(k.get("share")), "share_lo": _f(k.get("share_lo")), "share_hi": _f(k.get("share_hi")),
            "q_share": _f(k.get("q_share")),
            "significant": k.get("significant"),
            "alpha_gain": _f(k.get("alpha_gain")), "alpha_gain_lo": g_lo, "alpha_gain_hi": g_hi,
            "gain_verdict": judged(k.get("gain_verdict"), g_lo, g_hi, band) if k.get("alpha_gain") is not None else None,
            "alpha_growth": _f(k.get("alpha_growth")), "alpha_growth_lo": w_lo, "alpha_growth_hi": w_hi,
            "growth_verdict": judged(k.get("growth_verdict"), w_lo, w_hi, band) if k.get("alpha_growth") is not None else None,
        })
    return sorted(out, key=lambda k: k["kind"])
