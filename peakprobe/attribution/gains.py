"""Per-site loss attribution (``attribute``): every softmax's ``sensitivity`` (d L / d log beta),
``curvature``, optimal-temperature ``gain`` and ``log_beta_opt``, over a few evaluation windows.

Owns the pass's order: the model in eval mode under ``tempered``, the slopes' backward and the
beta = 1 cache (``runner._Runner``), then every site's search (``sites``: the LM head, single
heads screened, searched, estimated or off (``AttributionConfig.heads``), each layer, all
attention), one by one or in lockstep. What each number means and how it is computed, its cost
and its sampling noise: docs/attribution.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from .. import vocab
from .runner import Batch, _Runner
from .sites import attribution_rows as _attribution_rows
from .tempered import tempered

HEAD_MODES = ("screen", "estimate", "search", "off")


def attribute(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    *,
    heads: str = "screen",
    progress: bool = False,
    desc: str = "attribution",
    lockstep: bool | None = None,
) -> pd.DataFrame:
    """Attribution metrics of every site over ``batches`` (tidy: site_kind, layer, head, metric,
    value, n_rows; n_rows = next-token targets). ``heads``: "screen", "estimate", "search" or "off" (see
    the module doc). ``lockstep``: every site's search advances together, each round a few
    batched forwards (``sites``); None: on a GPU, where small forwards leave it waiting on
    launches (on CPU a head's evaluation recomputes that head alone, which is cheaper). The
    model is unchanged afterwards."""
    if heads not in HEAD_MODES:
        raise vocab.PeakprobeError(f"heads must be one of {', '.join(HEAD_MODES)}, got {heads!r}")
    was_training = model.training
    model.eval()
    try:
        with tempered(model) as state:
            run = _Runner(state, batches)
            grads = run.gradients()
            run.base()
            if lockstep is None:
                lockstep = run.logits[0].is_cuda
            return _attribution_rows(run, grads, heads=heads, progress=progress, desc=desc,
                                     lockstep=lockstep)
    finally:
        model.train(was_training)
