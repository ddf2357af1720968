"""The terminal text of a fitted run (`peakprobe fit` prints ``format_fits``): every verdict with
its interval, the band and the window, and the fits that were skipped and why."""

from __future__ import annotations

import math
from functools import partial

from peakprobe import vocab
from peakprobe.formatting import num, pct

from .run import RunFits

#: the terminal's numbers: three decimals (or ``fmt``), n/a when missing
_n = partial(num, fmt=".3f", missing="n/a")
_pct = partial(pct, fmt=".0f", missing="n/a")

KIND_LABELS = {vocab.BOTTLENECK_ATTENTION: "attention", vocab.BOTTLENECK_LM_HEAD: "LM head"}


def _t(v: float) -> str:
    """A time for a window: whole numbers from 100 up, three significant digits below."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _pct_ci(lo: float | None, hi: float | None) -> str:
    """A share interval; an upper end past 10 x L - L0 is shown as such, not as digits."""
    top = ">1000%" if hi is not None and math.isfinite(hi) and hi > 10 else _pct(hi)
    return f"[{_pct(lo)}, {top}]"


def _loss_lines(rf: RunFits, band: str, where: str) -> list[str]:
    """The loss law with its verdict, and its exponent against the window's start."""
    doc, lines = rf.verdict, []
    loss = rf.loss
    if loss is None:
        if not any(s["fit"] == vocab.FIT_LOSS for s in doc.get("skipped", [])):
            lines.append("loss: no LM-head loss in the results")
    else:
        lines.append(
            f"loss: L = {_n(loss.L0, fmt='.2f')} + {_n(loss.c, fmt='#.3g')} t^-{_n(loss.alpha)}; "
            f"alpha {_n(loss.alpha)} [{_n(loss.alpha_lo)}, {_n(loss.alpha_hi)}] "
            f"({100 * vocab.CI_LEVEL:.0f}% CI) -> {doc['loss']['verdict']} ({band}; {where})"
        )
        scan = doc["loss_scan"]["rows"]
        if scan:
            alphas = [r["alpha"] for r in scan if r["alpha"] is not None]
            drift = ("DRIFTS: a later start's interval misses the full window's"
                     if doc["loss_scan"]["drift"] else "no drift")
            lines.append(f"loss alpha vs window start: {min(alphas):.3f} to {max(alphas):.3f} "
                         f"over {len(scan)} starts ({drift})")
    return lines


def _bottleneck_lines(b: dict, band: str, n_sites: int) -> list[str]:
    """The verdict, each kind's share and exponents, the head counts and the top sites."""
    lines = []
    lines.append(f"bottleneck: {b['verdict']} - {b['reason']}")
    for name, k in b["kinds"].items():
        if k["share"] is None:
            continue
        lines.append(
            f"  {KIND_LABELS.get(name, name)}: share {_pct(k['share'])} "
            f"[{_pct(k['share_lo'])}, {_pct(k['share_hi'])}] of the loss decrease "
            f"({_pct(k.get('share_floor'))} of L - L0 at the end; gain of {k['site']}); "
            "gain alpha "
            f"{_n(k['alpha_gain'])} [{_n(k['alpha_gain_lo'])}, {_n(k['alpha_gain_hi'])}] "
            f"-> {k['gain_verdict']}; growth alpha {_n(k['alpha_growth'])} "
            f"[{_n(k['alpha_growth_lo'])}, {_n(k['alpha_growth_hi'])}] -> "
            f"{k['growth_verdict']} ({band})"
        )
    lines.append(
        f"attention heads: {b['n_peaked']} of {b['n_heads']} peaked; {b['n_concentrating']} "
        f"concentrating, {b['n_saturated']} saturated, {b['n_diffuse']} diffuse "
        f"(growth tested with Benjamini-Hochberg at {b['fdr']:g}); "
        f"{b['n_share_significant']} sites with a significant gain share (> {b['share_min']:g})"
    )
    if b["top_sites"]:
        lines.append(f"top sites (gain share of the loss decrease [{vocab.CI_LEVEL:.0%} CI], its BH q, "
                     "gain alpha, late logit_std alpha, d loss / d log beta):")
        for s in b["top_sites"][:n_sites]:
            q = "n/a" if s["q_share"] is None else f"{s['q_share']:.2f}"
            lines.append(f"  {s['label']:<16} share {_pct(s['share'])} "
                         f"{_pct_ci(s['share_lo'], s['share_hi'])} q {q}  gain alpha "
                         f"{_n(s['alpha_gain'])}  alpha {_n(s['alpha_late'])}  "
                         f"sensitivity {_n(s['sensitivity'], fmt='.4g')}")
    return lines


def format_fits(run_fits: RunFits, n_sites: int = 5) -> str:
    """A few lines: window, loss law with its three-way verdict, the scan, the bottleneck
    verdict with shares and exponents, BH-controlled head counts, top sites, flags."""
    rf = run_fits
    doc = rf.verdict
    band = f"band [{rf.band[0]:g}, {rf.band[1]:g}]"
    win = doc["window"]
    where = (f"window {rf.time_axis} {_t(win['t_min'])}-{_t(win['t_max'])}, "
             f"{win['n_points']} checkpoints")
    lines = [
        f"{rf.model or rf.run_dir.name}: {win['n_points']} checkpoints fitted on {rf.time_axis} "
        f"{_t(win['t_min'])}-{_t(win['t_max'])} (steps {win['step_min']}-{win['step_max']}; "
        f"start: {win['start_rule']})"
    ]
    if doc["excluded"]:
        lines.append("excluded (duplicate weights): "
                     + ", ".join(e["revision"] for e in doc["excluded"]))
    for s in doc.get("skipped", []):
        lines.append(f"SKIPPED {s['fit']} fit: {s['reason']}")
    lines += _loss_lines(rf, band, where)
    if doc["spikes"]:
        lines.append("loss spikes: " + ", ".join(s["revision"] for s in doc["spikes"]))
    lines += _bottleneck_lines(doc["bottleneck"], band, n_sites)
    if doc["flags"]:
        lines.append("flags: " + ", ".join(doc["flags"]))
    return "\n".join(lines)
