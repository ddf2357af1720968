"""The optimal-temperature gain of each mixture-of-experts router (``router_gains``).

For router l and x = log beta, beta multiplies that router's logits (all else fixed) and L(x) is
the mean next-token cross-entropy over the attribution windows. beta enters through the
router's input: a forward pre-hook scales the hidden states the router reads by beta, which
scales its logits by beta exactly for a router linear in its input without a bias (OLMoE,
Mixtral, Qwen-MoE: ``F.linear(h, W)``); each router is checked to be so on the first batch
(its logits at 2h against twice its logits at h) and is skipped otherwise. The router module
computes the gate weights and the top-k choice from the scaled logits itself, so both follow
beta as they would if the logits were scaled: the top-k set changes only through ties (a
positive beta keeps the order of the logits), the gate weights change through the softmax.

Per router: ``sensitivity`` d L / d x at 0 (one backward pass for every router at once),
``gain`` G = L(0) - min_x L(x) and ``log_beta_opt`` from ``search.minimize_log_beta`` (each
evaluation one forward over the windows), ``curvature`` the search's secant. Site kind
``vocab.ROUTER``, head -1.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from .. import vocab
from ..hooks.moe import Router, find_routers
from .runner import _ce_sum, _full, _targets
from .search import minimize_log_beta

Batch = tuple


class _Scaled:
    """Forward pre-hooks scaling each router's input by exp(x[layer])."""

    def __init__(self, routers: Sequence[Router]):
        self.routers = list(routers)
        self.x: dict[int, torch.Tensor] = {}
        self.handles = [r.module.register_forward_pre_hook(self._hook(r.layer)) for r in self.routers]

    def _hook(self, layer: int):
        def hook(module, args):
            x = self.x.get(layer)
            if x is None or not args:
                return None
            h = args[0]
            return (h * torch.exp(x).to(h.dtype),) + tuple(args[1:])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _linear(r: Router, model: torch.nn.Module, ids: torch.Tensor, mask) -> bool:
    """Whether router ``r`` scales its logits by 2 when its input is doubled (float rounding)."""
    seen: list[torch.Tensor] = []
    handle = r.module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=ids[:1], attention_mask=None if mask is None else mask[:1], use_cache=False)
    finally:
        handle.remove()
    if not seen:
        return False
    h = seen[0]
    with torch.no_grad():
        one, two = r.module(h), r.module(2 * h)
    one = one[r.index] if isinstance(one, (tuple, list)) else one
    two = two[r.index] if isinstance(two, (tuple, list)) else two
    return bool(torch.allclose(two.double(), 2 * one.double(), rtol=1e-4, atol=1e-6))


def _loss_sum(model, batches: Sequence[Batch]) -> tuple[torch.Tensor, int]:
    total, n = 0.0, 0
    for batch in batches:
        ids, mask, pos = _full(batch)
        dev = next(model.parameters()).device
        ids = ids.to(dev)
        mask = None if mask is None else mask.to(dev)
        kw = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
        if pos is not None:
            kw["position_ids"] = pos.to(dev)
        tgt = _targets(ids, mask, kw.get("position_ids"))
        total = total + _ce_sum(model(**kw).logits, tgt)
        n += int((tgt != -100).sum())
    return total, n


def router_gains(model: torch.nn.Module, batches: Sequence[Batch], *, progress: bool = False,
                 desc: str = "router gains") -> pd.DataFrame:
    """``vocab.ATTRIBUTION_METRICS`` of every router over ``batches`` (tidy: site_kind, layer,
    head, metric, value, n_rows = next-token targets); empty for a dense model. The model is
    unchanged afterwards."""
    cols = ["site_kind", "layer", "head", "metric", "value", "n_rows"]
    routers = find_routers(model)
    if not routers or not batches:
        return pd.DataFrame(columns=cols)
    ids, mask, _ = _full(batches[0])
    dev = next(model.parameters()).device
    mask0 = None if mask is None else mask.to(dev)
    usable = [r for r in routers if _linear(r, model, ids.to(dev), mask0)]
    if len(usable) < len(routers):
        warnings.warn(f"{len(routers) - len(usable)} router(s) are not linear in their input without a "
                      "bias; their gains are not measured", vocab.PeakprobeWarning, stacklevel=2)
    was_training = model.training
    model.eval()
    scaled = _Scaled(usable)
    rows = []
    try:
        for r in usable:  # one backward for every router's slope
            scaled.x[r.layer] = torch.zeros((), dtype=torch.float64, device=dev, requires_grad=True)
        with torch.enable_grad():
            total, n = _loss_sum(model, batches)
            (total / n).backward()
        slopes = {layer: float(x.grad) for layer, x in scaled.x.items()}
        f0 = float(total.detach()) / n
        for r in tqdm(usable, desc=desc, disable=not progress, leave=False, unit="router"):
            def f(x: float, layer: int = r.layer) -> float:
                scaled.x = {layer: torch.tensor(x, dtype=torch.float64, device=dev)}
                with torch.no_grad():
                    return float(_loss_sum(model, batches)[0]) / n
            res = minimize_log_beta(f, f0, slopes[r.layer])
            values = {vocab.SENSITIVITY: res.slope, vocab.CURVATURE: res.curvature,
                      vocab.GAIN: res.gain, vocab.LOG_BETA_OPT: res.x}
            rows += [(vocab.ROUTER, r.layer, -1, m, float(values[m]), n) for m in vocab.ATTRIBUTION_METRICS]
    finally:
        scaled.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return pd.DataFrame(rows, columns=cols)
