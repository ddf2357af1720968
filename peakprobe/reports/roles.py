"""Head roles across checkpoints, read off the role scores (``vocab.ROLE_METRICS``) and the sink
mass (``vocab.FIRST_KEY_PROB``) of every attention head.

At each checkpoint a head's role is the role of ``vocab.ROLE_OF`` whose score is largest, when
that score is at least ``vocab.ROLE_THRESHOLD`` (else none). A role *emerges* at the first
checkpoint from which its score stays at or above the threshold through the last checkpoint.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from peakprobe import vocab

ROLE_COLUMNS = ("site_kind", "layer", "head", "role", "role_score", "role_step")


def head_roles(results: pd.DataFrame) -> pd.DataFrame:
    """One row per attention head with role scores: its role at the last checkpoint (empty
    string for none), that role's score, and the step at which the role emerged (-1 for none).
    ``results``: tidy rows with step, site_kind, layer, head, metric, value."""
    names = {metric: role for role, metric in vocab.ROLE_OF.items()}
    rows = results[(results["site_kind"] == vocab.ATTN) & results["metric"].isin(list(names))]
    if rows.empty or not rows["metric"].isin(list(vocab.ROLE_METRICS)).any():
        return pd.DataFrame(columns=list(ROLE_COLUMNS))
    wide = rows.pivot_table(index=["layer", "head", "step"], columns="metric", values="value",
                            aggfunc="first").sort_index()
    out = []
    for (layer, head), g in wide.groupby(level=["layer", "head"]):
        scores = g.droplevel(["layer", "head"])  # (steps, metrics)
        last = scores.iloc[-1]
        best, best_v = "", -np.inf
        for metric in scores.columns:
            v = float(last[metric])
            if np.isfinite(v) and v >= vocab.ROLE_THRESHOLD and v > best_v:
                best, best_v = metric, v
        step = -1
        if best:
            above = (scores[best].to_numpy(dtype=float) >= vocab.ROLE_THRESHOLD)
            below = np.flatnonzero(~above)
            first = int(below[-1]) + 1 if len(below) else 0
            step = int(scores.index[first])
        out.append((vocab.ATTN, int(layer), int(head), names.get(best, ""),
                    best_v if best else np.nan, step))
    return pd.DataFrame(out, columns=list(ROLE_COLUMNS))
