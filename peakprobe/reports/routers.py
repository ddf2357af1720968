"""The report's view of mixture-of-experts routers: one row per router (``router_table``), its
per-checkpoint series for the figure (``router_series``) and the digest's ``routers`` block.

A router is a site like any other (growth fits, verdict, class, gain), so its fitted columns come
from fits.parquet exactly as the heads table's do; this module adds the router's own figures at
the last checkpoint: the top-k mass and the load balance (``vocab.LOAD_METRICS``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from peakprobe import vocab
from peakprobe.reports.tables import RunData

#: the last checkpoint's values each router row shows
ROUTER_FINAL: tuple[str, ...] = (
    vocab.LOGIT_STD, vocab.ENTROPY, vocab.MAX_PROB, vocab.TOPK_MASS, vocab.PEAKED,
) + vocab.LOAD_METRICS
ROUTER_COLUMNS: tuple[str, ...] = (
    "label", "layer", "alpha", "alpha_lo", "alpha_hi", "verdict", "site_class", "peaked",
    "share", "share_lo", "share_hi",
) + tuple(f"final_{m}" for m in ROUTER_FINAL)


def router_table(run: RunData) -> pd.DataFrame:
    """One row per router layer (empty for a dense model), columns ``ROUTER_COLUMNS``: the
    growth fit of its logit_std with the 1/3 verdict and class, its gain share when the run has
    router gains, and its last-checkpoint statistics and load figures."""
    res = run.results
    mine = res[(res["site_kind"] == vocab.ROUTER) & (res["revision"] == run.last_revision)]
    if mine.empty:
        return pd.DataFrame(columns=list(ROUTER_COLUMNS))
    final = mine.pivot_table(index="layer", columns="metric", values="value", aggfunc="first")
    fits = run.fits[run.fits["site_kind"] == vocab.ROUTER]
    growth = fits[(fits["fit"] == vocab.FIT_GROWTH) & (fits["metric"] == vocab.LOGIT_STD)]
    growth = growth.drop_duplicates("layer", keep="last").set_index("layer")
    gain = fits[fits["fit"] == vocab.FIT_GAIN].drop_duplicates("layer", keep="last").set_index("layer")
    out = pd.DataFrame(index=final.index.astype("int64"))
    out["label"] = [vocab.site_label(vocab.ROUTER, int(k)) for k in out.index]
    out["layer"] = out.index
    for col, default in (("alpha", np.nan), ("alpha_lo", np.nan), ("alpha_hi", np.nan),
                         ("verdict", ""), ("site_class", ""), ("peaked", False)):
        col_values = growth[col].reindex(out.index) if col in growth.columns else None
        out[col] = default if col_values is None else col_values.where(col_values.notna(), default)
    for col in ("share", "share_lo", "share_hi"):
        out[col] = gain[col].reindex(out.index) if col in gain.columns else np.nan
    for m in ROUTER_FINAL:
        out[f"final_{m}"] = final[m].reindex(out.index) if m in final.columns else np.nan
    out["peaked"] = out["peaked"].astype(bool)
    return out[list(ROUTER_COLUMNS)].reset_index(drop=True)


def router_series(run: RunData, metric: str = vocab.LOGIT_STD) -> pd.DataFrame:
    """``metric`` of every router at every checkpoint: columns layer, step, t, value."""
    res = run.results
    rows = res[(res["site_kind"] == vocab.ROUTER) & (res["metric"] == metric)]
    out = rows[["layer", "step", "tau", "value"]].copy()
    out["t"] = out["tau"] if run.time_axis == "tau" else out["step"].astype(float)
    return out[["layer", "step", "t", "value"]].sort_values(["layer", "step"], kind="stable")


def routers_block(table: pd.DataFrame) -> list[dict]:
    """The digest's ``routers``: one dict per row of ``router_table``."""
    return [{k: (r[k] if not isinstance(r[k], np.generic) else r[k].item()) for k in ROUTER_COLUMNS}
            for _, r in table.iterrows()]
