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

from peakprobe.reports.tables import THIRD, RunData, sensitivity_ranking, site_label

SUMMARY_FORMAT = 1
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


def loss_relation(
    alpha: float | None, lo: float | None, hi: float | None, third_in_ci: Any = None
) -> str:
    """How the loss exponent sits against 1/3: consistent, faster, slower or undetermined.

    fits.json's ``third_in_ci`` decides when given; otherwise the 90% CI [lo, hi] is compared to 1/3.
    """
    if isinstance(third_in_ci, bool) and alpha is not None and math.isfinite(alpha):
        if third_in_ci:
            return "consistent"
        return "faster" if alpha > THIRD else "slower"
    if alpha is None or lo is None or hi is None or not all(map(math.isfinite, (alpha, lo, hi))):
        return "undetermined"
    if lo > THIRD:
        return "faster"
    if hi < THIRD:
        return "slower"
    return "consistent"


def _loss_block(run: RunData) -> dict | None:
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
    block["third_distance_ci"] = _clean(given.get("third_distance_ci"))
    block["relation"] = loss_relation(
        block["alpha"], block["alpha_lo"], block["alpha_hi"], third_in_ci
    )
    return block


def _site(row: Any) -> dict:
    return {
        "site_kind": str(row["site_kind"]),
        "layer": int(row["layer"]),
        "head": int(row["head"]),
    }


def build_summary(run: RunData, heads: pd.DataFrame, figures: list[str]) -> dict:
    """The summary.json object (documented field by field in docs/summary_schema.md)."""
    m = run.manifest
    res = run.results
    steps = res.drop_duplicates("revision")[["revision", "step"]]
    bottleneck = dict(run.verdicts.get("bottleneck") or {})
    top_sites = [
        {
            "site_kind": s.get("site_kind"),
            "layer": s.get("layer"),
            "head": s.get("head"),
            "alpha": s.get("alpha"),
            "sensitivity": s.get("sensitivity"),
        }
        for s in bottleneck.get("top_sites") or []
    ]
    lm = heads[heads["site_kind"] == "lm_head"]
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
                "final_entropy",
                "final_max_prob",
                "final_loss",
                "sensitivity",
            )
        }
        lm_block["site_class"] = str(r["site_class"])
    attn = heads[heads["site_kind"] == "attn"]
    ranking = sensitivity_ranking(heads)
    data = m.get("data") or {}
    summary = {
        "format": SUMMARY_FORMAT,
        "model": m.get("model"),
        "source": m.get("source"),
        "time_axis": run.time_axis,
        "checkpoints": {
            "n": int(len(steps)),
            "n_planned": len(m.get("checkpoints") or []),
            "n_failed": len(run.failures),
            "first_revision": str(steps.iloc[0]["revision"]),
            "first_step": int(steps.iloc[0]["step"]),
            "last_revision": run.last_revision,
            "last_step": run.last_step,
        },
        "data": {k: data.get(k) for k in ("spec", "n_windows", "window", "token_hash")},
        "versions": dict(m.get("versions") or {}),
        "loss": _loss_block(run),
        "bottleneck": {
            "verdict": bottleneck.get("verdict"),
            "reason": bottleneck.get("reason"),
            "n_concentrating": bottleneck.get("n_concentrating"),
            "n_saturated": bottleneck.get("n_saturated"),
            "n_diffuse": bottleneck.get("n_diffuse"),
            "lm_head_alpha": bottleneck.get("lm_head_alpha"),
            "attn_alpha_median": bottleneck.get("attn_alpha_median"),
            "top_sites": top_sites,
        },
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


def summary_markdown(s: dict) -> str:
    """summary.md: the verdicts, the key numbers and the provenance, for a terminal or a README."""
    lines = [f"# peakprobe report: {_code(s['model'])}", ""]
    loss = s["loss"]
    if loss is None:
        lines.append("- **Loss law:** no loss fit in this run.")
    else:
        lines.append(
            f"- **Loss law:** L = L0 + c·t^-α with α = {_n(loss['alpha'])} "
            f"[{_n(loss['alpha_lo'])}, {_n(loss['alpha_hi'])}] (90% CI), L0 = {_n(loss['L0'])}; "
            f"{relation_text(loss['relation'])}."
        )
    b = s["bottleneck"]
    lines.append(
        f"- **Bottleneck:** {_md(b['verdict'] or 'undetermined')}"
        + (f" — {_md(b['reason'])}" if b["reason"] else "")
    )
    lines.append(
        f"- **Heads:** {_n(b['n_concentrating'])} concentrating, {_n(b['n_saturated'])} saturated, "
        f"{_n(b['n_diffuse'])} diffuse; median attention α {_n(b['attn_alpha_median'])}; "
        f"LM head α {_n(b['lm_head_alpha'])}."
    )
    if s["flags"]:
        lines.append(f"- **Flags:** {_md(', '.join(s['flags']))}")
    lines.append("")
    if b["top_sites"]:
        lines += ["## Top sites", "", "| site | α | sensitivity |", "|---|---|---|"]
        for t in b["top_sites"]:
            lines.append(
                f"| {site_label(t['site_kind'], t['layer'] if t['layer'] is not None else -1, t['head'] if t['head'] is not None else -1)} "
                f"| {_n(t['alpha'])} | {_n(t['sensitivity'])} |"
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
                f"| {site_label(t['site_kind'], t['layer'], t['head'])} | {_n(t['sensitivity'])} "
                f"| {_n(t['alpha'])} | {t['site_class'] or '—'} |"
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


def relation_text(relation: str) -> str:
    return {
        "consistent": "consistent with 1/3 (1/3 lies in the CI)",
        "faster": "faster than 1/3 (the whole CI is above 1/3)",
        "slower": "slower than 1/3 (the whole CI is below 1/3)",
    }.get(relation, "undetermined (no finite CI)")
