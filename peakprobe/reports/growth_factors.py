"""Why each head's logits grow: the growth exponents of the RMS logit's exact factors.

logit_rms = scaling * q_rms * k_rms * qk_align (``probes.geometry``), so log logit_rms is the sum
of the factors' logs plus a constant. The decomposition fits each of the four by least squares
on log-log axes over the same checkpoints (the logit_rms growth fit's window), and least squares
is linear in the data: the factors' exponents add up to logit_rms's exactly (to rounding). The
robust (Huber) growth fits of fits.parquet need not add up exactly, since each series gets its
own weights. Per peaked attention head (every head when none is peaked) this module lists the
four exponents, their sum, and the factor that carries the growth: the one with the largest
exponent; beside them, over the same window, the exponent of the head's weight figure
qk_spectral_norm (the norm of W_Q^T W_K: growth in the weights themselves), not a factor.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from peakprobe import vocab
from peakprobe.reports.tables import RunData, series

FACTOR_NAMES = {vocab.Q_RMS: "query norm", vocab.K_RMS: "key norm", vocab.QK_ALIGN: "alignment"}
FACTOR_COLUMNS = ("label", "layer", "head", "peaked", "alpha_logit_rms",
                  *(f"alpha_{m}" for m in vocab.LOGIT_FACTORS), "alpha_sum", "carrier",
                  f"alpha_{vocab.QK_SPECTRAL}")


def _ls_exponents(run: RunData, layer: int, head: int, t_min: float, t_max: float) -> dict:
    """Least-squares log-log slopes of logit_rms, its factors and the weight figure over
    [t_min, t_max] (NaN for a series with fewer than two points there)."""
    out = {}
    for m in (vocab.LOGIT_RMS,) + vocab.LOGIT_FACTORS + (vocab.QK_SPECTRAL,):
        t, v = series(run, vocab.ATTN, layer, head, m)
        keep = (t >= t_min) & (t <= t_max) & (v > 0)
        out[m] = (float(np.polyfit(np.log(t[keep]), np.log(v[keep]), 1)[0])
                  if keep.sum() >= 2 else np.nan)
    return out


def factor_table(run: RunData, heads: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(one row per head, ``FACTOR_COLUMNS``; which heads: "peaked heads" or "all heads")."""
    fits = run.fits
    g = fits[(fits["fit"] == vocab.FIT_GROWTH) & (fits["site_kind"] == vocab.ATTN)
             & fits["metric"].isin((vocab.LOGIT_RMS,) + vocab.LOGIT_FACTORS)]
    if g.empty:
        return pd.DataFrame(columns=list(FACTOR_COLUMNS)), ""
    base = g[g["metric"] == vocab.LOGIT_RMS].drop_duplicates(["layer", "head"], keep="last")
    wide = pd.DataFrame([_ls_exponents(run, int(r.layer), int(r.head), float(r.t_min), float(r.t_max))
                         for r in base.itertuples()],
                        index=pd.MultiIndex.from_arrays([base["layer"], base["head"]]))
    attn = heads[heads["site_kind"] == vocab.ATTN].set_index(["layer", "head"])
    peaked = attn["peaked"].reindex(wide.index).fillna(False).astype(bool)
    which = "peaked heads" if peaked.any() else "all heads"
    if peaked.any():
        wide = wide[peaked.to_numpy()]
    rows = []
    for (layer, head), r in wide.iterrows():
        alphas = {m: float(r.get(m, np.nan)) for m in vocab.LOGIT_FACTORS}
        finite = {m: a for m, a in alphas.items() if np.isfinite(a)}
        carrier = FACTOR_NAMES[max(finite, key=finite.get)] if finite else ""
        rows.append((vocab.site_label(vocab.ATTN, layer, head), int(layer), int(head),
                     bool(peaked.get((layer, head), False)), float(r.get(vocab.LOGIT_RMS, np.nan)),
                     *alphas.values(), float(sum(alphas.values())), carrier,
                     float(r.get(vocab.QK_SPECTRAL, np.nan))))
    return pd.DataFrame(rows, columns=list(FACTOR_COLUMNS)), which


def factors_block(run: RunData, heads: pd.DataFrame) -> dict:
    """The digest's ``logit_factors``: which heads, and one dict per head."""
    table, which = factor_table(run, heads)
    return {"measured": not table.empty, "heads_of": which,
            "rows": [{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}
                     for r in table.to_dict("records")]}
