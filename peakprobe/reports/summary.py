"""``summary.json`` (verdicts and key numbers; schema in docs/summary_schema.md) and ``summary.md``.

Owns: assembling the summary dictionary from fits.json, fits.parquet, the per-site table and the
manifest, and writing its Markdown rendering. Nothing here depends on the clock or the command
line, so the same run always gives the same bytes; NaN and infinities become JSON ``null``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from peakprobe.reports import science
from peakprobe.reports.tables import RunData, sensitivity_ranking
from peakprobe.vocab import (
    ATTN,
    BOTTLENECK_ATTENTION,
    BOTTLENECK_LM_HEAD,
    BOTTLENECK_NONE,
    CONSISTENT,
    INCONSISTENT,
    LM_HEAD,
    site_label,
)

SUMMARY_FORMAT = 2
TOP_SENSITIVE = 10


def _clean(x: Any) -> Any:
    """A JSON-safe copy: numpy scalars to Python, NaN/inf to None, containers recursively."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(float(x)) else None
    if x is None or (isinstance(x, str)):
        return x
    if pd.isna(x):
        return None
    return str(x)


def verdict_text(verdict: str, band: tuple[float, float], lo: Any = None, hi: Any = None) -> str:
    """One sentence saying why an interval [lo, hi] got its three-way verdict, with the band."""
    b = f"[{band[0]:g}, {band[1]:g}]"
    if verdict == CONSISTENT:
        return f"the interval contains 1/3 and lies inside the band {b}"
    if verdict == INCONSISTENT:
        return "1/3 lies outside the interval"
    if lo is None or hi is None:
        return "there is no finite interval"
    return f"the interval contains 1/3 but reaches outside the band {b}"


def _loss_block(run: RunData, band: tuple[float, float]) -> dict | None:
    f = run.fits
    rows = f[(f["fit"] == "loss")]
    given = run.verdicts.get("loss") or {}
    if rows.empty and not given:
        return None
    row = rows.iloc[-1] if not rows.empty else None
    block: dict[str, Any] = {}
    for key in (
        "alpha",
        "alpha_lo",
        "alpha_hi",
        "L0",
        "L0_lo",
        "L0_hi",
        "c",
        "r2",
        "t_min",
        "t_max",
    ):
        value = given.get(key) if key in given else (row[key] if row is not None else None)
        block[key] = _clean(value)
    block["n_points"] = _clean(row["n_points"]) if row is not None else None
    block["flags"] = [s for s in str(row["flags"]).split(";") if s] if row is not None else []
    third_in_ci = given.get("third_in_ci")
    block["third_in_ci"] = bool(third_in_ci) if isinstance(third_in_ci, bool) else None
    block["verdict"] = science.judged(
        given.get("verdict"), block["alpha_lo"], block["alpha_hi"], band
    )
    block["verdict_text"] = verdict_text(
        block["verdict"], band, block["alpha_lo"], block["alpha_hi"]
    )
    block["band"] = list(band)
    return block


def _site(row: Any) -> dict:
    return {
        "site_kind": str(row["site_kind"]),
        "layer": int(row["layer"]),
        "head": int(row["head"]),
    }


BOTTLENECK_TITLES = {
    BOTTLENECK_ATTENTION: "Attention heads are the bottleneck",
    BOTTLENECK_LM_HEAD: "The LM head is the bottleneck",
    BOTTLENECK_NONE: "No softmax bottleneck",
}


TOP_SITE_KEYS = (
    "site_kind",
    "layer",
    "head",
    "peaked",
    "share",
    "share_lo",
    "share_hi",
    "q_share",
    "alpha_gain",
    "gain_verdict",
    "alpha_late",
    "site_class",
    "sensitivity",
)


def _bottleneck_block(run: RunData, band: tuple[float, float]) -> dict:
    given = dict(run.verdicts.get("bottleneck") or {})
    verdict = given.get("verdict")
    kinds = science.bottleneck_kinds(run, band)
    named = next((k for k in kinds if k["kind"] == verdict), None)
    exponents = []
    if named is not None:
        for q, key in (("gain G decay", "gain"), ("logit_std growth", "growth")):
            if named[f"{key}_verdict"] is not None:
                exponents.append({
                    "label": named["label"],
                    "quantity": q,
                    "alpha": named[f"alpha_{key}"],
                    "alpha_lo": named[f"alpha_{key}_lo"],
                    "alpha_hi": named[f"alpha_{key}_hi"],
                    "verdict": named[f"{key}_verdict"],
                })
    return {
        "verdict": verdict,
        "title": BOTTLENECK_TITLES.get(
            verdict, f"Bottleneck: {verdict}" if verdict else "Bottleneck undetermined"
        ),
        "reason": given.get("reason"),
        "share": named["share"] if named else None,
        "share_lo": named["share_lo"] if named else None,
        "share_hi": named["share_hi"] if named else None,
        "exponents": exponents,
        "kinds": kinds,
        **{
            k: given.get(k)
            for k in (
                "share_min",
                "fdr",
                "n_heads",
                "n_peaked",
                "n_concentrating",
                "n_saturated",
                "n_diffuse",
                "n_share_significant",
            )
        },
        "top_sites": [
            {k: t.get(k) for k in TOP_SITE_KEYS} for t in given.get("top_sites") or []
        ],
    }


def build_summary(run: RunData, heads: pd.DataFrame, figures: list[str]) -> dict:
    """The summary.json object (documented field by field in docs/summary_schema.md)."""
    m = run.manifest
    steps = run.results.drop_duplicates("revision")[["revision", "step"]]
    band = science.band_of(run)
    loss = _loss_block(run, band)
    exponents = science.exponents_block(run, band, loss)
    lm = heads[heads["site_kind"] == LM_HEAD]
    lm_block = None
    if not lm.empty:
        r = lm.iloc[0]
        lm_block = {
            k: r[k]
            for k in (
                "alpha",
                "alpha_lo",
                "alpha_hi",
                "r2",
                "final_logit_std",
                "final_peaked",
                "final_peaked_entropy",
                "final_beta_eff",
                "final_entropy",
                "final_max_prob",
                "final_loss",
                "sensitivity",
            )
        }
        lm_block["site_class"] = str(r["site_class"])
    attn = heads[heads["site_kind"] == ATTN]
    ranking = sensitivity_ranking(heads)
    data = m.get("data") or {}
    summary = {
        "format": SUMMARY_FORMAT,
        "model": m.get("model"),
        "source": m.get("source"),
        "time_axis": run.time_axis,
        "band": list(band),
        "ci_level": science.ci_level_of(run),
        "checkpoints": {
            "n": int(len(steps)),
            "n_planned": len(m.get("checkpoints") or []),
            "n_failed": len(run.failures),
            "first_revision": str(steps.iloc[0]["revision"]),
            "first_step": int(steps.iloc[0]["step"]),
            "last_revision": run.last_revision,
            "last_step": run.last_step,
            **science.integrity_block(run),
        },
        "data": {k: data.get(k) for k in ("spec", "n_windows", "window", "token_hash")},
        "versions": dict(m.get("versions") or {}),
        "loss": loss,
        "exponents": exponents,
        "bottleneck": _bottleneck_block(run, band),
        "peakedness": science.peakedness_block(run, heads),
        "gains": science.gains_block(run, band),
        "window_scan": science.window_scan_block(run, band),
        "lm_head": lm_block,
        "attention": {
            "n_sites": int(len(attn)),
            "n_layers": int(attn["layer"].max()) + 1 if not attn.empty else 0,
            "n_heads": int(attn["head"].max()) + 1 if not attn.empty else 0,
            "n_fitted": int(np.isfinite(attn["alpha"]).sum()),
            "class_counts": {
                c: int((attn["site_class"] == c).sum())
                for c in ("concentrating", "saturated", "diffuse")
            },
        },
        "sensitivity": {
            "measured": bool(len(ranking)),
            "order": "ascending d loss / d log beta (most negative first)",
            "top": [
                {
                    **_site(r),
                    "sensitivity": r["sensitivity"],
                    "alpha": r["alpha"],
                    "site_class": str(r["site_class"]),
                }
                for _, r in ranking.head(TOP_SENSITIVE).iterrows()
            ],
        },
        "flags": [str(x) for x in run.verdicts.get("flags") or []],
        "figures": sorted(figures),
    }
    return _clean(summary)


def _n(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _md(text: Any) -> str:
    """User text made safe inside a Markdown table cell or line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: Any) -> str:
    """User text (names, revisions, hashes) as a Markdown code span, so it renders literally."""
    body = str(text).replace("\n", " ")
    fence = "`"
    while fence in body:
        fence += "`"
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def _ci(e: dict) -> str:
    return f"{_n(e['alpha'])} [{_n(e['alpha_lo'])}, {_n(e['alpha_hi'])}]"


def _window(e: dict) -> str:
    pts = f", {e['n_points']} pts" if e.get("n_points") is not None else ""
    return f"{_n(e['t_min'])}–{_n(e['t_max'])}{pts}"


def _label(t: dict) -> str:
    return site_label(
        t["site_kind"],
        t["layer"] if t["layer"] is not None else -1,
        t["head"] if t["head"] is not None else -1,
    )


def dup_text(d: dict, code: Any = str) -> str:
    """One duplicated checkpoint in words (``code`` formats revision names)."""
    text = code(d["revision"])
    if d["same_as"]:
        text += " has the same weights as " + ", ".join(code(x) for x in d["same_as"])
    if d["whole"] is False:
        text += f" (partly: {', '.join(d['files'])})"
    if d["excluded"]:
        text += " — excluded from the fits"
    else:
        text += " — NOT excluded by this fit (re-run `peakprobe fit`)"
    return text


def _pct(x: Any) -> str:
    return "—" if x is None else f"{100 * x:.3g}%"


def _yes(x: Any) -> str:
    return {True: "yes", False: "no"}.get(x, "—")


def heads_line(b: dict) -> str:
    """The head counts of the bottleneck block, in words (parts fit did not write are left out)."""
    parts = []
    if b["n_heads"] is not None:
        parts.append(f"{_n(b['n_peaked'])} of {_n(b['n_heads'])} attention heads peaked")
    parts.append(
        f"{_n(b['n_concentrating'])} concentrating, {_n(b['n_saturated'])} saturated, "
        f"{_n(b['n_diffuse'])} diffuse"
    )
    if b["n_share_significant"] is not None:
        parts.append(
            f"{_n(b['n_share_significant'])} sites with a gain share significantly above "
            f"{_pct(b['share_min'])} (Benjamini-Hochberg, FDR {_n(b['fdr'])})"
        )
    return "; ".join(parts) + "."


def summary_markdown(s: dict) -> str:
    """summary.md: the verdicts, the key numbers and the provenance, for a terminal or a README."""
    band = f"[{_n(s['band'][0])}, {_n(s['band'][1])}]"
    lines = [f"# peakprobe report: {_code(s['model'])}", ""]
    p = s["peakedness"]
    if p["any_peaked"] is False:
        lines += [f"> **No softmax is peaked.** {p['statement']}", ""]
    loss = s["loss"]
    if loss is None:
        lines.append("- **Loss law:** no loss fit in this run.")
    else:
        lines.append(
            f"- **Loss law:** L = L0 + c·t^-α with α = {_ci(loss)} "
            f"({s['ci_level']:.0%} CI), L0 = {_n(loss['L0'])}, window {s['time_axis']} "
            f"{_window(loss)}; **{loss['verdict']}** against 1/3 (band {band}): "
            f"{loss['verdict_text']}."
        )
    b = s["bottleneck"]
    line = f"- **Bottleneck:** {_md(b['verdict'] or 'undetermined')}"
    if b["share"] is not None:
        line += f" (its gain is {_pct(b['share'])} [{_pct(b['share_lo'])}, {_pct(b['share_hi'])}] of L − L0)"
    if b["reason"]:
        line += f" — {_md(b['reason'])}"
    lines.append(line)
    for e in b["exponents"]:
        lines.append(f"  - {e['label']} {e['quantity']}: α = {_ci(e)}, {e['verdict']}")
    lines.append(f"- **Heads:** {heads_line(b)}")
    if s["flags"]:
        lines.append(f"- **Flags:** {_md(', '.join(s['flags']))}")
    lines.append("")
    if s["exponents"]:
        lines += [
            "## Exponents against 1/3",
            "",
            f"Band {band}; window in {s['time_axis']}.",
            "",
            "| site | quantity | α [CI] | verdict | window |",
            "|---|---|---|---|---|",
        ]
        for e in s["exponents"]:
            lines.append(
                f"| {e['label']} | {e['quantity']} | {_ci(e)} | {e['verdict']} | {_window(e)} |"
            )
        lines.append("")
    lines += ["## Loss contribution G per softmax", ""]
    if not s["gains"]["measured"]:
        lines += ["Not measured in this run (the sweep ran without gains).", ""]
    else:
        lines += [
            "| site | final G | share of L − L0 [CI] | decay α [CI] | verdict | window |",
            "|---|---|---|---|---|---|",
        ]
        for g in s["gains"]["sites"]:
            share = f"{_pct(g['share'])} [{_pct(g['share_lo'])}, {_pct(g['share_hi'])}]"
            window = _window(g) if g["t_min"] is not None else "—"
            lines.append(
                f"| {g['label']} | {_n(g['final_gain'])} | {share} | {_ci(g)} | {g['verdict'] or '—'} | {window} |"
            )
        lines.append("")
    lines += ["## Window scan α(t_min)", ""]
    if not s["window_scan"]["measured"]:
        lines += ["Not measured (fits.json has no window scan).", ""]
    else:
        if s["window_scan"]["drift"]:
            lines += ["**The exponent drifts with the window start** (two starts give disjoint intervals).", ""]
        lines += ["| quantity | t_min | t_max | α [CI] | verdict |", "|---|---|---|---|---|"]
        for r in s["window_scan"]["rows"]:
            lines.append(
                f"| {_md(r['quantity'])} | {_n(r['t_min'])} | {_n(r['t_max'])} | {_ci(r)} | {r['verdict']} |"
            )
        lines.append("")
    lines += ["## Peakedness", "", _md(p["statement"]), ""]
    if p["criteria"]:
        lines += ["| criterion | attention heads peaked | LM head |", "|---|---|---|"]
        for c in p["criteria"]:
            heads = f"{c['n_attn_peaked']} of {c['n_attn']}" if c["measured"] else "not measured"
            lines.append(f"| {c['label']} | {heads} | {_n(c['lm_head'])} |")
        lines.append("")
    ck = s["checkpoints"]
    lines += ["## Checkpoint integrity", ""]
    if ck["duplicates"]:
        lines.append(f"Duplicated checkpoints ({len(ck['duplicates'])}):")
        for d in ck["duplicates"]:
            lines.append(f"- {dup_text(d, _code)}")
    else:
        lines.append(
            "No duplicated checkpoint found."
            if ck["integrity_checked"]
            else "Duplicated checkpoints: not checked (no integrity.json)."
        )
    if ck["spikes"]:
        lines.append(f"Loss spikes flagged by the fit, still fitted ({len(ck['spikes'])}):")
        for d in ck["spikes"]:
            lines.append(f"- {_code(d['revision'])}: loss {_n(d['loss'])}, jump {_n(d['jump'])}")
    else:
        lines.append("No spike-flagged checkpoint.")
    lines.append("")
    if b["kinds"]:
        lines += [
            "## Evidence per kind",
            "",
            "| kind | peaked | share of L − L0 [CI] | q | gain decay α [CI] | verdict | logit_std growth α [CI] | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k in b["kinds"]:
            lines.append(
                f"| {k['label']} | {_yes(k['peaked'])} | {_pct(k['share'])} [{_pct(k['share_lo'])}, {_pct(k['share_hi'])}] "
                f"| {_n(k['q_share'])} | {_n(k['alpha_gain'])} [{_n(k['alpha_gain_lo'])}, {_n(k['alpha_gain_hi'])}] "
                f"| {k['gain_verdict'] or '—'} | {_n(k['alpha_growth'])} [{_n(k['alpha_growth_lo'])}, {_n(k['alpha_growth_hi'])}] "
                f"| {k['growth_verdict'] or '—'} |"
            )
        lines.append("")
    if b["top_sites"]:
        lines += [
            "## Top sites",
            "",
            "| site | peaked | share [CI] | gain α | verdict | class | sensitivity |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in b["top_sites"]:
            lines.append(
                f"| {_label(t)} | {_yes(t['peaked'])} | {_pct(t['share'])} [{_pct(t['share_lo'])}, {_pct(t['share_hi'])}] "
                f"| {_n(t['alpha_gain'])} | {t['gain_verdict'] or '—'} | {t['site_class'] or '—'} | {_n(t['sensitivity'])} |"
            )
        lines.append("")
    sens = s["sensitivity"]
    lines.append("## Sensitivity ranking")
    lines.append("")
    if not sens["measured"]:
        lines += ["Not measured in this run (the sweep ran without sensitivity).", ""]
    else:
        lines += [
            "Most negative d loss / d log β first.",
            "",
            "| site | d loss / d log β | α | class |",
            "|---|---|---|---|",
        ]
        for t in sens["top"]:
            lines.append(
                f"| {_label(t)} | {_n(t['sensitivity'])} | {_n(t['alpha'])} | {t['site_class'] or '—'} |"
            )
        lines.append("")
    c, d = s["checkpoints"], s["data"]
    lines += [
        "## Provenance",
        "",
        f"- model: {_code(s['model'])} (source: {_code(s['source'])})",
        f"- checkpoints: {c['n']} finished of {c['n_planned']} planned ({c['n_failed']} failed), "
        f"{_code(c['first_revision'])} … {_code(c['last_revision'])}; time axis {s['time_axis']}",
        f"- data: {_code(d['spec'])}, {_n(d['n_windows'])} windows × {_n(d['window'])} tokens, {_code(d['token_hash'])}",
        "- versions: "
        + ", ".join(f"{_md(k)} {_code(v)}" for k, v in sorted(s["versions"].items())),
        "",
    ]
    return "\n".join(lines)
