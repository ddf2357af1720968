"""Attaching probes to every softmax of a Hugging Face causal LM, and detaching them cleanly.

One architecture-independent path: the model's attention calls are routed through
``Probe._attention`` (``routing``: transformers' ``AttentionInterface``, with the original mask
function beside it so the model builds the masks it always did), which hands the query/key
states and the masking to the statistics engine (``engine.SiteStats``) and the call on to the
model's original attention function, so the model's outputs are unchanged (with
``ProbeConfig(fused=True)`` the output is computed from the probe's own scores instead: QK^T
once, outputs within float rounding of eager attention). The LM head is read from the model's
returned logits (exactly what its softmax sees, final softcapping included) by a forward hook on
the model; a mixture-of-experts model's routers by forward hooks on the router modules
transformers itself records router logits from (``moe``). Packed documents are probed per
document: with ``position_ids`` restarting at 0 the model builds their block-diagonal mask itself, flash attention's ``cu_seq_lens`` become each
row's document start, and the LM head has no target across a document boundary. ``attach`` undoes all of it on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pandas as pd
import torch

from .. import vocab
from ..config import ProbeConfig
from ..probes import MaskSpec
from ..probes.ranges import cu_seq_starts
from ..probes.roles import diagnostic_batch, role_targets
from .engine import SiteStats, lm_targets, resolve_backend, unembed_sums
from .moe import hook_routers
from .routing import UnsupportedModelError, call_original, original_attention, route_attention


def softmax_kwargs(module, query, key, attention_mask, kwargs: dict) -> dict:
    """What of the attention interface's keyword arguments shapes the softmax, as arguments of
    ``SiteStats.attention``: scaling, causal / sliding-window structure and the mask, Gemma-2
    softcapping, a learned sink logit (gpt-oss ``s_aux``; a per-query ``sinks`` tensor), an
    additive ``position_bias``, and flash attention's packed documents (``cu_seq_lens_q`` of a
    one-row batch). ``dropout`` is training-only (the probes run in eval mode) and
    ``position_ids`` only feed the rotary embedding."""
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    spec = MaskSpec(mask=attention_mask, causal=causal, sliding_window=kwargs.get("sliding_window"),
                    q_offset=key.shape[2] - query.shape[2])
    doc_start = None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
            raise UnsupportedModelError("packed sequences (cu_seq_lens) are probed in batches of one "
                                        "row without a KV cache")
        doc_start = cu_seq_starts(cu.to(query.device), query.shape[2])
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    bias = kwargs.get("position_bias")
    return {
        "spec": spec,
        "scaling": float(scaling),
        "softcap": kwargs.get("softcap"),
        "sinks": None if sinks is None else sinks.detach(),
        "position_bias": None if bias is None else bias.detach(),
        "doc_start": doc_start,
    }


class Probe:
    """Accumulates statistics for one attached model. Use through ``attach``."""

    def __init__(self, model: torch.nn.Module, config: ProbeConfig, delegate: Callable | None):
        self.model = model
        self.config = config
        self.stats = SiteStats(config)
        self._delegate = delegate  # original attention function; None = the module's own eager
        self._layers: dict[int, int] = {}
        self._input_ids: torch.Tensor | None = None
        self._attention_mask: torch.Tensor | None = None
        self._position_ids: torch.Tensor | None = None
        self.n_attention_calls = 0
        self._roles_only = False  # the diagnostic batch runs: attention role scores alone
        self._hidden: torch.Tensor | None = None  # the final hidden states the LM head read

    @property
    def accumulator(self):
        return self.stats.accumulator

    # -- hooks ---------------------------------------------------------------------------
    def _layer_index(self, module: torch.nn.Module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._layers.setdefault(id(module), len(self._layers))
        return int(idx)

    def _capture_inputs(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._input_ids = ids if isinstance(ids, torch.Tensor) else None
        mask = kwargs.get("attention_mask")  # a padding mask (B, T); a custom 4-D one reaches attention
        self._attention_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        pos = kwargs.get("position_ids")
        self._position_ids = pos if isinstance(pos, torch.Tensor) else None

    def _row_valid(self, query: torch.Tensor) -> torch.Tensor | None:
        am = self._attention_mask
        if am is not None and am.dim() == 2 and am.shape[-1] == query.shape[2]:
            return am.to(query.device).bool()  # (B, Tq)
        return None

    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        self.n_attention_calls += 1
        kw = softmax_kwargs(module, query, key, attention_mask, kwargs)
        out = self.stats.attention(self._layer_index(module), query, key, value, module=module,
                                   row_valid=self._row_valid(query), want_output=True, **kw)
        if out is not None:
            return out, None
        return call_original(self._delegate, module, type(module), query, key, value, attention_mask, **kwargs)

    def _router(self, layer: int, logits: torch.Tensor, top_k: int) -> None:
        if self._roles_only:
            return
        am = self._attention_mask
        if am is not None and am.numel() == logits.shape[0]:
            kept = am.reshape(-1).bool()  # routers see the batch's tokens flattened (B * T, E)
        else:
            kept = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        self.stats.router(layer, logits, kept, top_k)

    def _lm_head(self, module, args, kwargs, output) -> None:
        if self._roles_only:
            return
        logits = getattr(output, "logits", None)
        ids = self._input_ids
        if logits is None or ids is None or logits.shape[1] != ids.shape[1]:
            return
        kept, target = lm_targets(ids, self._attention_mask, self._position_ids)
        hidden, self._hidden = self._hidden, None
        self.stats.lm_head(logits, kept, target, hidden)

    def _lm_input(self, module, args) -> None:
        self._hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None

    # -- public --------------------------------------------------------------------------
    def run_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> float:
        """Run the model on one batch under the probes; return the batch's mean next-token loss.

        ``position_ids`` restarting at 0 mark packed documents (then ``attention_mask`` is None,
        as ``DataCollatorWithFlattening`` builds them). A batch whose masks the Triton kernel's
        key ranges cannot express is probed again on the torch path."""
        device = next(self.model.parameters()).device
        inputs = {"input_ids": input_ids.to(device), "use_cache": False}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask.to(device)
        if position_ids is not None:
            inputs["position_ids"] = position_ids.to(device)
        # only the kernel path can misread a mask: keep what to return to for it alone
        kernel = resolve_backend(self.config.backend, inputs["input_ids"]) == "triton"
        before = self.stats.snapshot() if kernel else None
        with torch.no_grad():
            self.model(**inputs)
        broken, loss = self.stats.end_batch()  # the batch's one device-to-host copy
        if kernel and broken:  # a mask the kernel's ranges misread: the torch path
            self.stats.restore(before)
            self.stats.config = replace(self.config, backend="torch")
            try:
                with torch.no_grad():
                    self.model(**inputs)
            finally:
                self.stats.config = self.config
            _, loss = self.stats.end_batch()
        return loss  # computed block by block by the LM-head hook

    def run_roles(self, ids: torch.Tensor | None = None, period: int | None = None) -> None:
        """Run the diagnostic batch (``probes.roles.diagnostic_batch`` for this model's vocabulary
        and positions, or ``ids`` of period ``period``) and add every head's role scores
        (``vocab.ROLE_METRICS``); nothing else is counted from it."""
        if ids is None:
            cfg = self.model.config
            size = self.model.get_output_embeddings().weight.shape[0]
            max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
            ids, period = diagnostic_batch(size, max_pos)
        device = next(self.model.parameters()).device
        self.stats.role_targets = role_targets(ids.shape[1], int(period), device)
        self._roles_only = True
        try:
            with torch.no_grad():
                self.model(input_ids=ids.to(device), use_cache=False)
        finally:
            self._roles_only = False
            self.stats.role_targets = None

    def _unembed_rows(self, frame: pd.DataFrame) -> list[tuple]:
        """The LM head's mean unembedding row norm (a weight figure, n_rows = V)."""
        if self.model is None or not (frame["site_kind"] == vocab.LM_HEAD).any():
            return []
        total, n = unembed_sums(self.model.get_output_embeddings().weight)  # (V, D)
        return [(vocab.LM_HEAD, -1, -1, vocab.UNEMBED_NORM, total / n, n)]

    def to_frame(self) -> pd.DataFrame:
        """Tidy per-site values: site_kind, layer, head, metric, value, n_rows."""
        if self.stats.ranges_broken():
            raise UnsupportedModelError(
                "an attention mask the Triton kernel's key ranges cannot express reached it outside "
                "run_batch; probe with backend='torch'")
        frame = self.accumulator.to_frame()
        roles = self.stats.role_rows() + self.stats.geometry_rows() + self._unembed_rows(frame)
        if roles:
            extra = pd.DataFrame(roles, columns=list(frame.columns))
            frame = pd.concat([frame, extra], ignore_index=True).sort_values(
                ["site_kind", "layer", "head", "metric"], kind="stable")
        return frame.reset_index(drop=True)


def _check_supported(model: torch.nn.Module) -> None:
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface; "
            "peakprobe cannot see its softmaxes (probe it with peakprobe.integrations.attach_sdpa "
            "if it calls torch.nn.functional.scaled_dot_product_attention)"
        )
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no LM head (get_output_embeddings() is None)")


@contextmanager
def attach(model: torch.nn.Module, config: ProbeConfig | None = None) -> Iterator[Probe]:
    """Attach peakprobe to ``model`` for the duration of the ``with`` block.

    Inside, call ``probe.run_batch(input_ids, attention_mask)`` (or the model itself); after the
    block the model's attention implementation is restored and every hook is removed, also when
    the block raises.
    """
    config = config or ProbeConfig()
    _check_supported(model)
    probe = Probe(model, config, original_attention(model))
    handles = []
    try:
        with route_attention(model, probe._attention), hook_routers(model, probe._router):
            handles.append(model.register_forward_pre_hook(probe._capture_inputs, with_kwargs=True))
            handles.append(model.register_forward_hook(probe._lm_head, with_kwargs=True))
            handles.append(model.get_output_embeddings().register_forward_pre_hook(probe._lm_input))
            yield probe
            if probe.n_attention_calls == 0 and probe.accumulator.groups():
                raise UnsupportedModelError(
                    f"{type(model).__name__} ran without calling the attention interface; "
                    "its attention is not a softmax peakprobe can reach"
                )
    finally:
        for handle in handles:
            handle.remove()
        probe.model = None  # no reference cycle keeps the model alive
        probe.stats.clear()
