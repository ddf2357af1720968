"""An attention module's query and key projection weights, per head, in the layouts transformers
stores them in: the weight figure ``vocab.QK_SPECTRAL`` (``probes.geometry.qk_spectral_norms``).

Read from the module the attention interface hands the probe, with the query's head count and
head size as that call sees them (so a tensor-parallel rank reads its own heads):

* separate ``q_proj`` / ``k_proj`` Linear layers (Llama, Mistral, Qwen, OLMo, Gemma, gpt-oss and
  most others): rows (H d) and (Hkv d), head-major;
* ``GPTNeoXAttention`` / ``PersimmonAttention``'s fused ``query_key_value`` Linear: output rows
  laid out (H, 3, d), per head its q, k, v blocks (the modeling code's
  ``view(..., H, 3 d).chunk(3)``);
* ``Phi3Attention``'s fused ``qkv_proj`` Linear: rows [q (H d) | k (Hkv d) | v (Hkv d)];
* ``GPT2Attention``'s ``c_attn`` Conv1D: weight (D, 3 D), columns [q | k | v] (transposed
  relative to a Linear), self-attention only.

Any other layout (Falcon's and Bloom's fused projections, CodeGen's, multi-head latent attention,
quantised weights, shapes that do not match the call's heads) is not read: the figure is absent
for that layer. A DTensor weight sharded on its output rows (tensor parallel) is read as its
local shard; any other DTensor is not read (no collective inside the model's forward).
"""

from __future__ import annotations

import torch

#: attention classes whose fused projection is laid out (H, 3, d) per head
_PER_HEAD_QKV = ("GPTNeoXAttention", "PersimmonAttention")


def _local(weight) -> torch.Tensor | None:
    """``weight`` as this process holds it: a plain 2-D tensor, the local rows of a DTensor
    sharded on dimension 0, else None."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch without distributed tensors
        return weight.detach()
    if isinstance(weight, DTensor):
        if all(isinstance(p, Shard) and p.dim == 0 for p in weight.placements):
            return weight.to_local().detach()
        return None
    return weight.detach()


def _weight(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    return _local(getattr(getattr(module, name, None), "weight", None))


def _heads(w: torch.Tensor, rows: int, head_dim: int) -> torch.Tensor:
    """The first ``rows`` rows of a Linear weight (R, D) as (rows // d, d, D)."""
    return w[:rows].reshape(rows // head_dim, head_dim, w.shape[1])


def _fused(module: torch.nn.Module, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused layouts (the module doc)."""
    name = type(module).__name__
    if name in _PER_HEAD_QKV:
        w = _weight(module, "query_key_value")  # (H * 3 * d, D)
        if w is None or w.shape[0] != 3 * heads * d:
            return None
        blocks = w.reshape(heads, 3, d, w.shape[1])  # (H, [q, k, v], d, D)
        return blocks[:, 0], blocks[:, 1]
    if name == "Phi3Attention":
        w = _weight(module, "qkv_proj")  # ((H + 2 Hkv) d, D)
        kv = (w.shape[0] - heads * d) // 2 if w is not None else 0
        if kv <= 0 or kv % d or w.shape[0] != heads * d + 2 * kv:
            return None
        return _heads(w, heads * d, d), _heads(w[heads * d :], kv, d)
    if name == "GPT2Attention" and not getattr(module, "is_cross_attention", False):
        c = getattr(module, "c_attn", None)
        w = _local(getattr(c, "weight", None)) if type(c).__name__ == "Conv1D" else None
        if w is None or w.shape[1] != 3 * heads * d:
            return None
        wt = w.t()  # (3 H d, D): Conv1D computes x @ W, a Linear x @ W^T
        return _heads(wt, heads * d, d), _heads(wt[heads * d :], heads * d, d)
    return None


def qk_weights(module: torch.nn.Module, heads: int, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W_Q (H, d, D), W_K (Hkv, d, D)) of ``module`` for a call with ``heads`` query heads of
    size ``head_dim``, or None where the layout is not one of the module doc's (or the shapes
    do not fit the call's heads)."""
    out = _fused(module, heads, head_dim)
    if out is None:
        wq, wk = _weight(module, "q_proj"), _weight(module, "k_proj")
        if wq is None or wk is None or wq.shape[0] != heads * head_dim or wk.shape[0] % head_dim:
            return None
        out = _heads(wq, heads * head_dim, head_dim), _heads(wk, wk.shape[0], head_dim)
    wq, wk = out
    if wk.shape[0] == 0 or heads % wk.shape[0] or wq.shape[-1] != wk.shape[-1]:
        return None  # key groups that do not divide the query heads
    return wq, wk
