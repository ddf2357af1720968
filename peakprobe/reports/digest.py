"""The report's digest, written as ``summary.json``: verdicts and key numbers (schema in
docs/summary_schema.md).

Owns: assembling the digest from fits.json, fits.parquet, integrity.json, the per-site table
and the manifest (``summary.md`` renders it: reports/markdown.py). Nothing here depends on the clock or the command
line, so the same run always gives the same bytes; NaN and infinities become JSON ``null``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from peakprobe import vocab
from peakprobe.reports import science
from peakprobe.reports.growth_factors import factors_block
from peakprobe.reports.routers import router_table, routers_block
from peakprobe.reports.tables import RunData, sensitivity_ranking
from peakprobe.results import json_safe
from peakprobe.vocab import (
    ATTN,
    BOTTLENECK_ATTENTION,
    BOTTLENECK_LM_HEAD,
    BOTTLENECK_NONE,
    CONSISTENT,
    INCONSISTENT,
    LM_HEAD,
)

SUMMARY_FORMAT = 2
TOP_SENSITIVE = 10


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
    rows = f[(f["fit"] == vocab.FIT_LOSS)]
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
        block[key] = json_safe(value)
    block["n_points"] = json_safe(row["n_points"]) if row is not None else None
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


def _roles_block(run: RunData, heads: pd.DataFrame) -> dict:
    """Which attention heads hold a role at the last checkpoint, with its score and the step it
    emerged at (``reports.roles``)."""
    attn = heads[heads["site_kind"] == ATTN]
    named = attn[attn["role"] != ""]
    return {
        "measured": bool(run.results["metric"].isin(list(vocab.ROLE_METRICS)).any()),
        "threshold": vocab.ROLE_THRESHOLD,
        "counts": {role: int((named["role"] == role).sum()) for role in vocab.ROLE_OF},
        "heads": [{"label": vocab.site_label(ATTN, r.layer, r.head), "layer": int(r.layer),
                   "head": int(r.head), "role": r.role, "score": float(r.role_score),
                   "since_step": int(r.role_step)} for r in named.itertuples()],
    }


_LM_FIELDS = ("alpha", "alpha_lo", "alpha_hi", "r2", "final_logit_std", "final_peaked",
              "final_peaked_entropy", "final_beta_eff", "final_entropy", "final_max_prob",
              "final_loss", "sensitivity")


def _lm_head_block(heads: pd.DataFrame) -> dict | None:
    lm = heads[heads["site_kind"] == LM_HEAD]
    if lm.empty:
        return None
    r = lm.iloc[0]
    return {**{k: r[k] for k in _LM_FIELDS}, "site_class": str(r["site_class"])}


def _checkpoints_block(run: RunData) -> dict:
    steps = run.results.drop_duplicates("revision")[["revision", "step"]]
    return {
        "n": int(len(steps)),
        "n_planned": len(run.manifest.get("checkpoints") or []),
        "n_failed": len(run.failures),
        "first_revision": str(steps.iloc[0]["revision"]),
        "first_step": int(steps.iloc[0]["step"]),
        "last_revision": run.last_revision,
        "last_step": run.last_step,
        **science.integrity_block(run),
    }


def _attention_block(heads: pd.DataFrame) -> dict:
    attn = heads[heads["site_kind"] == ATTN]
    return {
        "n_sites": int(len(attn)),
        "n_layers": int(attn["layer"].max()) + 1 if not attn.empty else 0,
        "n_heads": int(attn["head"].max()) + 1 if not attn.empty else 0,
        "n_fitted": int(np.isfinite(attn["alpha"]).sum()),
        "class_counts": {c: int((attn["site_class"] == c).sum())
                         for c in ("concentrating", "saturated", "diffuse")},
    }


def _sensitivity_block(heads: pd.DataFrame) -> dict:
    ranking = sensitivity_ranking(heads)
    return {
        "measured": bool(len(ranking)),
        "order": "ascending d loss / d log beta (most negative first)",
        "top": [{**_site(r), "sensitivity": r["sensitivity"], "alpha": r["alpha"],
                 "site_class": str(r["site_class"])}
                for _, r in ranking.head(TOP_SENSITIVE).iterrows()],
    }


def build_digest(run: RunData, heads: pd.DataFrame, figures: list[str]) -> dict:
    """The summary.json object (documented field by field in docs/summary_schema.md)."""
    m = run.manifest
    band = science.band_of(run)
    loss = _loss_block(run, band)
    data = m.get("data") or {}
    summary = {
        "format": SUMMARY_FORMAT,
        "model": m.get("model"),
        "source": m.get("source"),
        "time_axis": run.time_axis,
        "band": list(band),
        "ci_level": science.ci_level_of(run),
        "checkpoints": _checkpoints_block(run),
        "data": {k: data.get(k) for k in ("spec", "n_windows", "window", "token_hash")},
        "versions": dict(m.get("versions") or {}),
        "loss": loss,
        "skipped": list(run.verdicts.get("skipped") or []),
        "exponents": science.exponents_block(run, band, loss),
        "bottleneck": _bottleneck_block(run, band),
        "peakedness": science.peakedness_block(run, heads),
        "gains": science.gains_block(run, band),
        "window_scan": science.window_scan_block(run, band),
        "lm_head": _lm_head_block(heads),
        "routers": routers_block(router_table(run)),
        "roles": _roles_block(run, heads),
        "logit_factors": factors_block(run, heads),
        "attention": _attention_block(heads),
        "sensitivity": _sensitivity_block(heads),
        "flags": [str(x) for x in run.verdicts.get("flags") or []],
        "figures": sorted(figures),
    }
    return json_safe(summary)
