"""Site classes and the bottleneck verdict (attention vs LM head).

Site class, from the fitted window's last checkpoint and the *late* logit_std fit (the power
law refitted on the second half of the window in log time, t >= sqrt(t_first * t_last)):

* ``concentrating``: peaked (the `peaked` fraction of rows, logit_std > sqrt(2 ln n), is
  >= 0.5) and still growing: the late alpha's lower CI bound exceeds GROWTH_FLOOR = 0.05;
* ``saturated``: peaked, not growing;
* ``diffuse``: not peaked;
* empty: not classifiable (no `peaked` metric or no logit_std fit for the site).

Verdict, from two independent signals:

1. growth: if some attention heads are concentrating and the LM head is not, growth says
   ``attention``; if the LM head is concentrating and no attention head is, ``lm_head``;
   otherwise (both or neither) growth gives no answer.
2. sensitivity (d loss / d log beta at the last checkpoint, measured by the sweep), compared
   kind against kind on one scale: one inverse temperature shared by all attention heads has
   d loss / d log beta = the sum of the heads' values (chain rule), the LM head's is its own.
   The kind whose shared sharpening lowers the loss more (the more negative of the two) is the
   answer, if that value is negative; with only one kind measured, that kind if negative; no
   negative value, or none measured, gives no answer. Comparing the single most negative site
   instead would pit one head against the whole LM head.

The verdict is the answer the signals agree on; one answer alone is the verdict; conflicting
answers, or none, give ``undetermined``. The reason string says which signals decided.

In the `bottleneck` block of fits.json, n_concentrating / n_saturated / n_diffuse count
attention heads; lm_head_alpha, attn_alpha_median (over concentrating attention heads) and
each top site's alpha are the late-window logit_std exponents the classes are based on.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

GROWTH_FLOOR = 0.05
PEAKED_FRACTION = 0.5
N_TOP_SITES = 10


def classify(peaked_final: float, late_alpha_lo: float) -> str:
    """The class of one site (see the module docstring); empty when not classifiable."""
    if not (math.isfinite(peaked_final) and math.isfinite(late_alpha_lo)):
        return ""
    if peaked_final < PEAKED_FRACTION:
        return "diffuse"
    return "concentrating" if late_alpha_lo > GROWTH_FLOOR else "saturated"


def _finite(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def _site_name(row: pd.Series) -> str:
    if row["site_kind"] == "lm_head":
        return "the LM head"
    return f"attn L{int(row['layer'])} H{int(row['head'])}"


def _growth_signal(sites: pd.DataFrame) -> tuple[str | None, str]:
    attn = sites[sites["site_kind"] == "attn"]
    lm = sites[sites["site_kind"] == "lm_head"]
    attn_conc = attn[attn["site_class"] == "concentrating"]
    lm_class = lm["site_class"].iloc[0] if len(lm) else ""
    lm_text = (
        f"the LM head is {lm_class or 'unclassified'}"
        + (f" (late alpha {lm['alpha_late'].iloc[0]:.3f})" if len(lm) and lm_class else "")
        if len(lm)
        else "there is no LM head"
    )
    if len(attn_conc):
        attn_text = (
            f"{len(attn_conc)} attention heads still concentrate "
            f"(median late alpha {attn_conc['alpha_late'].median():.3f})"
        )
    else:
        attn_text = "no attention head still concentrates"
    text = f"growth: {attn_text}; {lm_text}"
    lm_conc = lm_class == "concentrating"
    if len(attn_conc) and not lm_conc:
        return "attention", text
    if lm_conc and not len(attn_conc):
        return "lm_head", text
    return None, text + " (no answer)"


def _sensitivity_signal(sites: pd.DataFrame) -> tuple[str | None, str]:
    measured = sites[np.isfinite(sites["sensitivity"].to_numpy(dtype=float))]
    if not len(measured):
        return None, "sensitivity: not measured"
    attn = measured[measured["site_kind"] == "attn"]
    lm = measured[measured["site_kind"] == "lm_head"]
    totals = {}  # kind -> d loss / d log beta of one temperature shared by the kind's sites
    parts = []
    if len(attn):
        totals["attention"] = float(attn["sensitivity"].sum())
        parts.append(f"all {len(attn)} attention heads together {totals['attention']:.4g}")
    if len(lm):
        totals["lm_head"] = float(lm["sensitivity"].iloc[0])
        parts.append(f"the LM head {totals['lm_head']:.4g}")
    text = f"sensitivity (d loss / d log beta): {', '.join(parts)}"
    if len(attn):
        head = attn.loc[attn["sensitivity"].idxmin()]
        text += f"; most negative head {_site_name(head)} ({head['sensitivity']:.4g})"
    kind = min(totals, key=totals.__getitem__)
    if totals[kind] >= 0:
        return None, text + " (no answer: sharpening lowers no loss)"
    return kind, text


def top_sites(sites: pd.DataFrame, n: int = N_TOP_SITES) -> list[dict]:
    """Concentrating sites first, then by sensitivity (most negative first), then by late alpha."""
    order = sites.assign(
        _conc=(sites["site_class"] != "concentrating").astype(int),
        _sens=sites["sensitivity"].fillna(np.inf),
        _alpha=-sites["alpha_late"].fillna(-np.inf),
    ).sort_values(["_conc", "_sens", "_alpha", "site_kind", "layer", "head"], kind="stable")
    return [
        {
            "site_kind": str(r["site_kind"]),
            "layer": int(r["layer"]),
            "head": int(r["head"]),
            "alpha": _finite(r["alpha_late"]),
            "sensitivity": _finite(r["sensitivity"]),
        }
        for _, r in order.head(n).iterrows()
    ]


def bottleneck(sites: pd.DataFrame) -> dict:
    """The `bottleneck` block of fits.json from the per-site table.

    ``sites`` columns: site_kind, layer, head, alpha_late, site_class, sensitivity.
    """
    growth, growth_text = _growth_signal(sites)
    sens, sens_text = _sensitivity_signal(sites)
    answers = {a for a in (growth, sens) if a is not None}
    if len(answers) == 1:
        verdict = answers.pop()
        decided = " and ".join(n for n, a in (("growth", growth), ("sensitivity", sens)) if a)
        reason = f"decided by {decided}. {growth_text}; {sens_text}"
    elif answers:
        verdict = "undetermined"
        reason = f"the signals disagree. {growth_text}; {sens_text}"
    else:
        verdict = "undetermined"
        reason = f"no signal decides. {growth_text}; {sens_text}"
    attn = sites[sites["site_kind"] == "attn"]
    lm = sites[sites["site_kind"] == "lm_head"]
    conc = attn[attn["site_class"] == "concentrating"]
    return {
        "verdict": verdict,
        "reason": reason,
        "n_concentrating": int((attn["site_class"] == "concentrating").sum()),
        "n_saturated": int((attn["site_class"] == "saturated").sum()),
        "n_diffuse": int((attn["site_class"] == "diffuse").sum()),
        "lm_head_alpha": _finite(lm["alpha_late"].iloc[0]) if len(lm) else None,
        "attn_alpha_median": _finite(conc["alpha_late"].median()) if len(conc) else None,
        "top_sites": top_sites(sites),
    }
