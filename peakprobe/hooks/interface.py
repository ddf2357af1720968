"""Attaching probes to every softmax of a Hugging Face causal LM, and detaching them cleanly.

One architecture-independent path: a ``peakprobe_<n>`` function is registered with
transformers' ``AttentionInterface`` (and the original implementation's mask function under the
same name with ``AttentionMaskInterface``, so the model still builds the masks it always did), and
the model is switched to it with ``set_attn_implementation``. Every attention call then reaches
``Probe._attention``, which streams the per-head statistics from the query/key states and hands
the call on to the model's original attention function, so the model's outputs are unchanged
(with ``ProbeConfig(fused=True)`` the output is computed from the probe's own scores instead:
QK^T once, outputs within float rounding of eager attention).
The LM head is read from the model's returned logits (exactly what its softmax sees, final
softcapping included) by a forward hook on the model. ``attach`` undoes all of it on exit.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pandas as pd
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..config import ProbeConfig
from ..probes import (
    Accumulator,
    MaskSpec,
    SiteGroup,
    attention_forward_with_sums,
    attention_head_sums,
)
from ..probes.rows import block_sums, finish, target_logit
from ..probes.sums import Sums
from ..probes.workspace import Workspace

_names = itertools.count()
_STATS_DTYPES = {"float32": torch.float32, "float64": torch.float64}
LM_BLOCK_ELEMENTS = 1 << 20  # elements of one block of LM-head logits at most (one row may exceed it)
CPU_CHUNK = 32  # query rows per attention block on CPU (the fastest there: benchmarks/throughput.py)
#: elements of one block of logits on a GPU (attention and LM head): few large kernels, since
#: small blocks leave a GPU waiting on launches (docs/gpu.md)
GPU_BLOCK_ELEMENTS = 1 << 25


def block_rows(chunk: int | None, query: torch.Tensor, key: torch.Tensor) -> int:
    """Query rows per attention block: ``chunk`` if given; else CPU_CHUNK on CPU, and on a GPU
    the largest power of two (at least CPU_CHUNK) whose (B, H, rows, Tk) block of logits stays
    within GPU_BLOCK_ELEMENTS."""
    if chunk is not None:
        return chunk
    if not query.is_cuda:
        return CPU_CHUNK
    return gpu_rows(query.shape[0], query.shape[1], key.shape[2])


def gpu_rows(batch: int, heads: int, keys: int, budget: int | None = None) -> int:
    """The largest power of two, at least CPU_CHUNK, with batch x heads x rows x keys <= budget
    (GPU_BLOCK_ELEMENTS by default)."""
    budget = GPU_BLOCK_ELEMENTS if budget is None else budget
    rows = max(1, budget // max(1, batch * heads * keys))
    return max(CPU_CHUNK, 1 << (rows.bit_length() - 1))


class UnsupportedModelError(ValueError):
    """The model's softmaxes cannot be reached through the attention interface."""


def _softmax_kwargs(module, query, key, attention_mask, kwargs: dict) -> dict:
    """What of the attention interface's keyword arguments shapes the softmax, as arguments of
    ``attention_head_sums``: scaling, causal / sliding-window structure and the mask, Gemma-2
    softcapping, a learned sink logit (gpt-oss ``s_aux``; a per-query ``sinks`` tensor), an
    additive ``position_bias``. ``dropout`` is training-only (the probes run in eval mode) and
    ``position_ids`` only feed the rotary embedding; packed sequences (``cu_seq_lens_*``)
    carry their mask outside ``attention_mask`` and are refused."""
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise UnsupportedModelError(
            "packed sequences (cu_seq_lens) are not supported: probe unpacked, padded batches"
        )
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    spec = MaskSpec(
        mask=attention_mask,
        causal=causal,
        sliding_window=kwargs.get("sliding_window"),
        q_offset=key.shape[2] - query.shape[2],
    )
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    bias = kwargs.get("position_bias")
    return {
        "scaling": float(scaling),
        "mask": spec,
        "softcap": kwargs.get("softcap"),
        "sinks": None if sinks is None else sinks.detach(),
        "position_bias": None if bias is None else bias.detach(),
    }


def _check_compile(dtype: torch.dtype) -> None:
    """Backend "compile": build the fused reductions now, so a missing compiler is one
    ``CompileError`` before anything runs, not a failure at every checkpoint."""
    with torch.no_grad():  # as the probes run (grad mode is part of what is compiled)
        block_sums(torch.zeros(2, 2, 4, dtype=dtype), compiled=True)


def _triton_sums() -> Callable | None:
    try:
        from ..probes.triton_kernel import attention_head_sums_triton
    except ImportError:
        return None
    return attention_head_sums_triton


class Probe:
    """Accumulates statistics for one attached model. Use through ``attach``."""

    def __init__(self, model: torch.nn.Module, config: ProbeConfig, delegate: Callable | None):
        self.model = model
        self.config = config
        self.accumulator = Accumulator()
        self._delegate = delegate  # original attention function; None = the module's own eager
        self._layers: dict[int, int] = {}
        self._input_ids: torch.Tensor | None = None
        self._attention_mask: torch.Tensor | None = None
        self.n_attention_calls = 0
        self.last_loss = float("nan")
        self._work = Workspace()  # block-sized scratch, reused from block to block
        self._compiled = config.backend == "compile"
        self._sums_fn = attention_head_sums
        if self._compiled:
            self._sums_fn = functools.partial(attention_head_sums, compiled=True)
            _check_compile(_STATS_DTYPES[config.dtype])
        if config.backend == "triton":
            fast = _triton_sums()
            if fast is None:
                raise ValueError("backend='triton' needs the triton package (pip install triton)")
            self._fast_sums = fast
        else:
            self._fast_sums = None

    # -- hooks ---------------------------------------------------------------------------
    def _layer_index(self, module: torch.nn.Module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._layers.setdefault(id(module), len(self._layers))
        return int(idx)

    def _capture_inputs(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._input_ids = ids if isinstance(ids, torch.Tensor) else None
        self._attention_mask = kwargs.get("attention_mask")

    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        self.n_attention_calls += 1
        layer = self._layer_index(module)
        stats_kw = _softmax_kwargs(module, query, key, attention_mask, kwargs)
        row_valid = None
        am = self._attention_mask
        if am is not None and am.dim() == 2 and am.shape[-1] == query.shape[2]:
            row_valid = am.to(query.device).bool()  # (B, Tq)
        fused_out = None
        # Fused only without autograd: the probe's output carries no gradient.
        if self.config.fused and not torch.is_grad_enabled() and value is not None:
            fused_out, metrics, sums, counts = attention_forward_with_sums(
                query.detach(), key.detach(), value.detach(), row_valid=row_valid,
                chunk=block_rows(self.config.chunk, query, key), dtype=_STATS_DTYPES[self.config.dtype],
                work=self._work,
                **stats_kw,
            )  # fmt: skip
        else:
            sums_fn = functools.partial(self._sums_fn, work=self._work)
            if self._fast_sums is not None:
                sums_fn = self._fast_sums
            metrics, sums, counts = sums_fn(
                query.detach(), key.detach(), row_valid=row_valid,
                chunk=block_rows(self.config.chunk, query, key),
                dtype=_STATS_DTYPES[self.config.dtype], **stats_kw,
            )  # fmt: skip
        self.accumulator.add_sums(SiteGroup("attn", layer), metrics, sums, counts)

        if fused_out is not None:
            return fused_out, None
        if self._delegate is not None:
            return self._delegate(module, query, key, value, attention_mask, **kwargs)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise UnsupportedModelError(
                f"{type(module).__name__} has no eager_attention_forward to delegate to"
            )
        return eager(module, query, key, value, attention_mask, **kwargs)

    def _lm_head(self, module, args, kwargs, output) -> None:
        logits = getattr(output, "logits", None)
        ids = self._input_ids
        if logits is None or ids is None or logits.shape[1] != ids.shape[1]:
            return
        dtype = _STATS_DTYPES[self.config.dtype]
        am = self._attention_mask
        mask = torch.ones_like(ids, dtype=torch.bool) if am is None else am.bool()  # (B, T)
        target = torch.full_like(ids, -1)
        nxt_ok = mask[:, 1:] & mask[:, :-1]
        target[:, :-1] = torch.where(nxt_ok, ids[:, 1:], torch.full_like(ids[:, 1:], -1))
        # Positions per block: at most lm_chunk, and few enough that one (B, C, V) temporary
        # stays within LM_BLOCK_ELEMENTS whatever the vocabulary (the size of the attention
        # blocks, so both reuse the same workspace buffers instead of growing them).
        b, v = logits.shape[0], logits.shape[-1]
        budget = GPU_BLOCK_ELEMENTS if logits.is_cuda else LM_BLOCK_ELEMENTS
        step = max(1, min(self.config.lm_chunk, budget // max(1, b * v)))
        parts: list[Sums] = []  # per block of positions: (B, C) sums over the vocabulary
        targets = []
        with torch.no_grad():
            for t0 in range(0, ids.shape[1], step):
                t1 = min(ids.shape[1], t0 + step)
                z = logits[:, t0:t1].detach().to(dtype)  # (B, C, V)
                parts.append(block_sums(z, compiled=self._compiled, work=self._work))
                valid = torch.ones(1, 1, z.shape[-1], dtype=torch.bool, device=z.device)
                targets.append(target_logit(z, valid, target[:, t0:t1].to(z.device)))
            # every position's statistics at once: few large per-row operations, not many small
            keys = Sums(*(torch.cat([getattr(p, f) for p in parts], 1) for f in Sums.__dataclass_fields__))
            stats = finish(keys, mask.to(logits.device), target_logit=torch.cat(targets, 1), n_max=v)
            self.accumulator.add_rows(SiteGroup("lm_head", -1), stats, head_dim=None)
            loss_sum = (stats.values["loss"] * stats.weight["loss"]).sum().item()
            loss_n = stats.weight["loss"].sum().item()
        self.last_loss = loss_sum / loss_n if loss_n else float("nan")

    # -- public --------------------------------------------------------------------------
    def run_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> float:
        """Run the model on one batch under the probes; return the batch's mean next-token loss."""
        device = next(self.model.parameters()).device
        input_ids = input_ids.to(device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        with torch.no_grad():
            self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.last_loss  # computed block by block by the LM-head hook

    def to_frame(self) -> pd.DataFrame:
        """Tidy per-site means: site_kind, layer, head, metric, value, n_rows."""
        return self.accumulator.to_frame().reset_index(drop=True)


def _check_supported(model: torch.nn.Module) -> None:
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface; "
            "peakprobe cannot see its softmaxes"
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
    original = model.config._attn_implementation or "eager"
    delegate = None if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[original]
    probe = Probe(model, config, delegate)
    name = f"peakprobe_{next(_names)}"
    handles = []
    AttentionInterface.register(name, probe._attention)
    AttentionMaskInterface.register(name, mask_fn)
    try:
        model.set_attn_implementation(name)
        handles.append(model.register_forward_pre_hook(probe._capture_inputs, with_kwargs=True))
        handles.append(model.register_forward_hook(probe._lm_head, with_kwargs=True))
        yield probe
        if probe.n_attention_calls == 0 and probe.accumulator.groups():
            raise UnsupportedModelError(
                f"{type(model).__name__} ran without calling the attention interface; "
                "its attention is not a softmax peakprobe can reach"
            )
    finally:
        for handle in handles:
            handle.remove()
        if model.config._attn_implementation == name:
            model.set_attn_implementation(original)
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
        probe.model = None  # no reference cycle keeps the model alive
        probe._work.clear()
