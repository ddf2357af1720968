"""Finding a mixture-of-experts model's routers and hooking their logits, for any architecture.

transformers declares, per model, which module's output holds the router logits: the entry
``"router_logits"`` of the model's ``_can_record_outputs`` (an ``OutputRecorder`` naming the
router class and the output index; OLMoE, Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE, DBRX,
Phi-MoE and the rest). That is the one rule used here: a forward hook on every module of that
class hands its logits (tokens, experts) to a callback, with the layer index read from the
module's name (``model.layers.3.mlp.gate`` -> 3) and the model's top-k. Routers that score
experts with a sigmoid (``scoring_func`` other than softmax, DeepSeek-V3 style) are not
softmaxes and are not hooked.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..vocab import PeakprobeWarning

#: config attributes that hold the number of experts each token is sent to
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")


@dataclass(frozen=True)
class Router:
    """One hooked router: its layer, module, output index and top-k."""

    layer: int
    module: torch.nn.Module
    index: int
    top_k: int


def _recorder(model: torch.nn.Module):
    for m in (model, getattr(model, "model", None), getattr(model, "base_model", None)):
        spec = getattr(m, "_can_record_outputs", None) or {}
        if "router_logits" in spec:
            return spec["router_logits"]
    return None


def _top_k(module: torch.nn.Module, config) -> int | None:
    for owner in (module, config):
        for key in TOP_K_KEYS:
            v = getattr(owner, key, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _layer_of(name: str, fallback: int) -> int:
    m = re.search(r"\.(\d+)(\.|$)", name)
    return int(m.group(1)) if m else fallback


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The softmax routers of ``model`` (empty for a dense model), in layer order."""
    rec = _recorder(model)
    if rec is None:
        return []
    target = getattr(rec, "target_class", rec)
    index = int(getattr(rec, "index", 0) or 0)
    layer_name = getattr(rec, "layer_name", None)
    config = getattr(model, "config", None)
    scoring = getattr(config, "scoring_func", None)
    if scoring is not None and str(scoring).lower() != "softmax":
        warnings.warn(f"{type(model).__name__} scores its experts with {scoring!r}, not a softmax: "
                      "its routers are not probed", PeakprobeWarning, stacklevel=3)
        return []
    out = []
    for name, module in model.named_modules():
        if not isinstance(target, type) or not isinstance(module, target):
            continue
        if layer_name is not None and layer_name not in name:
            continue
        k = _top_k(module, config)
        if k is None:
            continue
        out.append(Router(_layer_of(name, len(out)), module, index, k))
    return sorted(out, key=lambda r: r.layer)


@contextmanager
def hook_routers(model: torch.nn.Module,
                 fn: Callable[[int, torch.Tensor, int], None]) -> Iterator[list[Router]]:
    """Call ``fn(layer, logits (N, E), top_k)`` on every router call of ``model`` inside the
    block; the hooks are removed on exit, also when the block raises."""
    routers = find_routers(model)
    handles = []

    def hook_for(r: Router):
        def hook(module, args, output) -> None:
            logits = output[r.index] if isinstance(output, (tuple, list)) else output
            if isinstance(logits, torch.Tensor) and logits.dim() >= 2:
                fn(r.layer, logits.reshape(-1, logits.shape[-1]), r.top_k)
        return hook

    try:
        for r in routers:
            handles.append(r.module.register_forward_hook(hook_for(r)))
        yield routers
    finally:
        for h in handles:
            h.remove()
