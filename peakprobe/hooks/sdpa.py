"""Probing any PyTorch model whose attention calls ``F.scaled_dot_product_attention``.

nanoGPT, litgpt, torchtitan's sdpa path and OLMo-core's torch backend compute attention with
``torch.nn.functional.scaled_dot_product_attention``. ``attach_sdpa(model)`` sees every such call
inside the model's forward through a ``TorchFunctionMode``: its query, key, mask, causal flag,
scale and grouped-query heads, exactly as the softmax gets them. Sites are numbered by call
order within one forward (site k is the k-th attention call: the k-th layer for the usual
decoder) and named by the innermost module that made the call (``SdpaProbe.site_names``). The
call itself runs unchanged. The LM head's statistics come from the logits the forward returns
(or that the user passes to ``SdpaProbe.lm_head``).

What it cannot see is said once, by name, never skipped silently: a forward that makes no sdpa
call at all (a custom or fused attention kernel), and calls of ``flex_attention`` or
``multi_head_attention_forward``, whose softmax it does not reconstruct.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pandas as pd
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import vocab
from ..config import ProbeConfig
from ..probes import MaskSpec
from .engine import SiteStats, lm_targets
from .routing import UnsupportedModelError


class UnprobedAttentionWarning(vocab.PeakprobeWarning):
    """An attention computation the sdpa probe cannot see (said once per kind)."""


def _unprobed_functions() -> dict[Callable, str]:
    """Attention functions whose softmax the probe does not reconstruct, by name."""
    found = {F.multi_head_attention_forward: "torch.nn.functional.multi_head_attention_forward"}
    try:
        from torch.nn.attention.flex_attention import flex_attention

        found[flex_attention] = "torch.nn.attention.flex_attention.flex_attention"
    except ImportError:  # older torch
        pass
    return found


def sdpa_mask(attn_mask: torch.Tensor | None, is_causal: bool) -> MaskSpec:
    """The ``MaskSpec`` of one sdpa call: ``is_causal`` is the causal mask aligned at the top
    left (query i sees keys 0..i), as sdpa defines it; ``attn_mask`` (bool: True attends;
    float: added to the scores) broadcast to (B|1, 1|H, Tq, Tk)."""
    if attn_mask is None:
        return MaskSpec(mask=None, causal=bool(is_causal), q_offset=0)
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return MaskSpec(mask=m, causal=False)


class SdpaProbe(TorchFunctionMode):
    """Accumulates the statistics of every sdpa call of one model. Use through ``attach_sdpa``."""

    def __init__(self, model: torch.nn.Module, config: ProbeConfig):
        super().__init__()
        self.model = model
        self.config = config
        self.stats = SiteStats(config)
        self.site_names: dict[int, str] = {}  # site -> the module that made the call
        self._call = 0  # sdpa calls in the current forward
        self._stack: list[str] = []  # names of the modules whose forward is running
        self._said: set[str] = set()
        self.n_calls = 0
        self.row_valid: torch.Tensor | None = None  # (B, Tq) rows to count in this forward

    @property
    def accumulator(self):
        return self.stats.accumulator

    def _say_once(self, what: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(what, UnprobedAttentionWarning, stacklevel=3)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._observe(*args, **kwargs)
        elif func in _UNPROBED:
            self._say_once(f"{_UNPROBED[func]} is called inside {type(self.model).__name__}: its "
                           "softmax is not probed (only F.scaled_dot_product_attention is)")
        return func(*args, **kwargs)

    def _observe(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False) -> None:
        site = self._call
        self._call += 1
        self.n_calls += 1
        if self._stack:
            self.site_names.setdefault(site, self._stack[-1])
        if query.dim() != 4 or key.dim() != 4:
            raise UnsupportedModelError(
                f"an sdpa call with query {tuple(query.shape)} is not (B, H, T, D): peakprobe "
                "probes batched multi-head attention")
        h, hkv = query.shape[1], key.shape[1]
        if h % hkv:
            raise UnsupportedModelError(f"sdpa call with {h} query heads and {hkv} key heads")
        b, tq = query.shape[0], query.shape[2]
        spec = sdpa_mask(attn_mask, is_causal)
        scaling = query.shape[-1] ** -0.5 if scale is None else float(scale)
        row_valid = self.row_valid if self.row_valid is not None and self.row_valid.shape == (b, tq) else None
        # inside __torch_function__ this mode is off: the probe's own ops are not seen again
        self.stats.attention(site, query, key, None, spec=spec, scaling=scaling, row_valid=row_valid)

    # -- a forward ---------------------------------------------------------------------------
    @contextmanager
    def forward(self) -> Iterator[None]:
        """One forward pass of the model: its sdpa calls are sites 0, 1, ... in call order."""
        self._call, self._stack = 0, []
        with self:
            yield
        if self._call == 0:
            self._say_once(f"{type(self.model).__name__} made no call of "
                           "F.scaled_dot_product_attention in its forward: its attention (a custom "
                           "or fused kernel) is not probed")

    def lm_head(self, logits: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> None:
        """Add the LM head's statistics of ``logits`` (B, T, V) against ``input_ids`` (B, T)."""
        kept, target = lm_targets(input_ids, attention_mask, position_ids)
        self.stats.lm_head(logits, kept, target)

    def run_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, forward: Callable | None = None) -> float:
        """Run ``forward(input_ids)`` (default: ``model(input_ids)``; it returns the logits or an
        object with ``.logits``) under the probe; the LM head's statistics from its logits.
        Returns the batch's mean next-token loss. ``attention_mask`` (B, T) marks the rows to
        count (padding the model itself must mask); ``position_ids`` restarting at 0 mark
        packed documents for the LM head (the model's own masks decide what attention sees)."""
        device = next(self.model.parameters()).device
        input_ids = input_ids.to(device)
        self.row_valid = None if attention_mask is None else attention_mask.to(device).bool()
        forward = forward or self.model
        try:
            with torch.no_grad(), self.forward():
                out = forward(input_ids)
        finally:
            self.row_valid = None
        logits = getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != input_ids.shape:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s forward returned {type(out).__name__}, not (B, T, V) "
                "logits: pass forward= returning them")
        self.lm_head(logits, input_ids, attention_mask, position_ids)
        return self.stats.loss()

    def to_frame(self) -> pd.DataFrame:
        """Tidy per-site values: site_kind, layer (the site's call order), head, metric, value,
        n_rows."""
        if self.stats.ranges_broken():
            raise UnsupportedModelError("an attention mask the Triton kernel's key ranges cannot "
                                        "express reached it; probe with backend='torch'")
        frame = self.accumulator.to_frame()
        extra = self.stats.geometry_rows()  # the heads' query-key geometry
        if extra:
            frame = pd.concat([frame, pd.DataFrame(extra, columns=list(frame.columns))],
                              ignore_index=True).sort_values(["site_kind", "layer", "head", "metric"],
                                                             kind="stable")
        return frame.reset_index(drop=True)


_UNPROBED = _unprobed_functions()


@contextmanager
def attach_sdpa(model: torch.nn.Module, config: ProbeConfig | None = None) -> Iterator[SdpaProbe]:
    """Probe ``model``'s sdpa attention inside the ``with`` block: ``probe.run_batch(ids)`` (or
    ``with probe.forward(): logits = model(ids)`` then ``probe.lm_head(logits, ids)``). Module
    hooks that name the sites are removed on exit, also when the block raises."""
    probe = SdpaProbe(model, config or ProbeConfig())
    names = {m: name for name, m in model.named_modules() if name}
    handles = []

    def enter(module, args):
        probe._stack.append(names[module])

    def leave(module, args, output):
        if probe._stack:
            probe._stack.pop()

    try:
        for module in names:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
        yield probe
    finally:
        for handle in handles:
            handle.remove()
        probe.stats.clear()
        probe.model = None
