"""The model under a per-layer, per-head inverse temperature beta, and the block caching the
attribution's evaluations use.

``tempered`` routes every attention call of a model through ``Tempered.attention``
(``hooks.routing``) and restores the model on exit. A call with a layer's beta computes that layer's
softmaxes with beta on their logits (``beta``); where only one head's beta differs from 1 and
the layer's beta = 1 output was recorded, only that head is computed again and spliced into it.
``decoder_layers`` finds the decoder blocks; ``cached_below`` makes the blocks below a layer
answer with cached outputs, ``recording`` records block outputs while inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..hooks.routing import call_original, original_attention, route_attention
from .beta import attention_with_beta, one_head, real_module


class Tempered:
    """The model under a per-layer, per-head beta. Use through ``tempered``."""

    def __init__(self, model: torch.nn.Module, delegate: Callable | None):
        self.model = model
        self._delegate = delegate  # original attention function; None = the module's own eager
        self.betas: dict[int, torch.Tensor] = {}  # layer -> (H,) beta; absent = untouched
        self.log_betas: dict[int, torch.Tensor] | None = None  # set: fresh grad leaves per call
        self.attention_modules: dict[int, torch.nn.Module] = {}
        self.n_heads: dict[int, int] = {}
        self._ids: dict[int, int] = {}
        self.record: dict[int, torch.Tensor] | None = None  # set: each layer's output lands here
        self.cached: dict[int, torch.Tensor] = {}  # layer -> its (B, T, H, D) output at beta = 1
        self.checked: dict[int, bool] = {}  # layer -> one-head calls reproduce ``cached``
        self.spliced = 0  # single-head calls answered from ``cached`` (counted for the tests)

    def _layer(self, module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._ids.setdefault(id(module), len(self._ids))
        return int(idx)

    def _original(self, module, query, key, value, attention_mask, **kwargs):
        return call_original(self._delegate, module, type(real_module(module)), query, key, value,
                             attention_mask, **kwargs)

    def _one_head_only(self, layer, module, query, key, value, attention_mask, beta, kwargs):
        """Where only one head's beta differs from 1: the beta = 1 output of this layer with that
        head's output computed again (B, T, H, D), or None (no cache, or the one-head calls do
        not reproduce it bit for bit at beta = 1; checked once a layer, for every head)."""
        cached = self.cached.get(layer)
        if cached is None or beta.dim() != 1:
            return None
        changed = torch.nonzero(beta != 1)
        if changed.numel() != 1:
            return None
        b, n, t = query.shape[:3]
        if cached.shape[:3] != (b, t, n):
            return None
        if layer not in self.checked:
            ones = torch.ones(1, dtype=beta.dtype, device=beta.device)
            try:  # an attention function that cannot take a one-head call: every head, as before
                outs = [one_head(self._original, module, query, key, value, attention_mask, h, ones,
                                 **kwargs) for h in range(n)]
            except Exception:
                outs = [None]
            self.checked[layer] = all(o is not None and torch.equal(o, cached[:, :, h : h + 1])
                                      for h, o in enumerate(outs))
        if not self.checked[layer]:
            return None
        head = int(changed)
        one = one_head(self._original, module, query, key, value, attention_mask, head, beta[head], **kwargs)
        out = cached.clone()
        out[:, :, head : head + 1] = one
        self.spliced += 1
        return out

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        layer = self._layer(module)
        self.attention_modules[layer] = module
        self.n_heads[layer] = query.shape[1]
        if self.log_betas is not None:
            lb = torch.zeros(query.shape[1], dtype=query.dtype, device=query.device, requires_grad=True)
            self.log_betas[layer] = lb
            beta = torch.exp(lb)
        else:
            beta = self.betas.get(layer)
        if beta is None:
            out = self._original(module, query, key, value, attention_mask, **kwargs)
        elif (spliced := self._one_head_only(layer, module, query, key, value, attention_mask,
                                             beta.to(query.device), kwargs)) is not None:
            return spliced, None
        else:
            out = attention_with_beta(self._original, module, query, key, value, attention_mask,
                                      beta.to(query.device), **kwargs)
        if self.record is not None:
            self.record[layer] = out[0].detach()
        return out


@contextmanager
def tempered(model: torch.nn.Module) -> Iterator[Tempered]:
    """Route every attention call of ``model`` through ``Tempered.attention``; restore on exit."""
    state = Tempered(model, original_attention(model))
    try:
        with route_attention(model, state.attention, prefix="peakprobe_beta"):
            yield state
    finally:
        state.model = None


def decoder_layers(model: torch.nn.Module, attention: dict[int, torch.nn.Module]) -> list | None:
    """The ModuleList whose block i contains the attention module of layer i, or None."""
    n = len(attention)
    if n == 0 or sorted(attention) != list(range(n)):
        return None
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            if all(any(m is attention[i] for m in block.modules()) for i, block in enumerate(mod)):
                return list(mod)
    return None


def outer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every ModuleList not nested in another's block (the decoder layers are
    among them; a mixture of experts' list inside a layer is not)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    outer = [m for name, m in lists
             if not any(name.startswith(other + ".") for other, _ in lists if other != name)]
    return [block for m in outer for block in m]


@contextmanager
def cached_below(layers: Sequence[torch.nn.Module], outputs: Sequence, stop: int) -> Iterator[None]:
    """Blocks below ``stop`` answer with their cached outputs instead of computing them."""
    saved = []
    try:
        for block, out in zip(layers[:stop], outputs[:stop], strict=True):
            saved.append((block, block.__dict__.get("forward")))
            block.forward = lambda *a, _out=out, **k: _out
        yield
    finally:
        for block, previous in saved:
            if previous is None:
                del block.forward
            else:
                block.forward = previous


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if type(out) in (tuple, list):
        return type(out)(_detached(o) for o in out)
    return out


@contextmanager
def recording(blocks: Sequence[torch.nn.Module]) -> Iterator[dict[int, object]]:
    """Record each block's (detached) output, keyed by id(block), while inside."""
    outs: dict[int, object] = {}
    handles = [b.register_forward_hook(lambda m, _a, out: outs.__setitem__(id(m), _detached(out)))
               for b in blocks]
    try:
        yield outs
    finally:
        for handle in handles:
            handle.remove()
