"""Per-head attention statistics from query and key states, in query-row chunks (torch path).

This is the reference implementation the optional Triton kernel must match. It rebuilds the
attention logits exactly as a Hugging Face attention function would (scaling, optional
softcapping, grouped-query heads, the additive or boolean mask, or causal / sliding-window
structure when no mask is materialised) one chunk of query rows at a time, so nothing of size
T x T per head ever exists beyond one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import ATTN_METRICS, row_stats


@dataclass(frozen=True)
class MaskSpec:
    """How the model masks attention, as the attention function received it.

    ``mask`` is None (structure given by ``causal`` / ``sliding_window``), a bool tensor
    (True = may attend) or an additive float tensor (a very negative entry = may not attend),
    of shape (B, 1 or H, Tq, Tk). ``q_offset`` is the position of query 0 among the keys.
    """

    mask: torch.Tensor | None = None
    causal: bool = True
    sliding_window: int | None = None
    q_offset: int = 0


def _chunk_logits(
    q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    """Scores of a query chunk against all keys, grouped-query heads expanded.

    q: (B, H, C, D); k: (B, Hkv, Tk, D) -> (B, H, C, Tk)
    """
    b, h, c, d = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    qg = q.reshape(b, hkv, groups, c, d)  # (B, Hkv, G, C, D)
    z = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # (B, Hkv, G, C, Tk)
    z = z.reshape(b, h, c, k.shape[2]) * scaling  # (B, H, C, Tk)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _chunk_valid(
    spec: MaskSpec, i0: int, i1: int, tk: int, device: torch.device, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with any additive mask applied, bool validity) for query rows i0:i1."""
    if spec.mask is None:
        qpos = torch.arange(i0, i1, device=device).unsqueeze(-1) + spec.q_offset  # (C, 1)
        kpos = torch.arange(tk, device=device).unsqueeze(0)  # (1, Tk)
        valid = torch.ones(i1 - i0, tk, dtype=torch.bool, device=device)
        if spec.causal:
            valid = valid & (kpos <= qpos)
        if spec.sliding_window is not None:
            valid = valid & (kpos > qpos - spec.sliding_window)
        return z, valid.view(1, 1, i1 - i0, tk)  # (1, 1, C, Tk)
    m = spec.mask[:, :, i0:i1, :tk]  # (B, 1|H, C, Tk)
    if m.dtype == torch.bool:
        return z, m
    lowest = torch.finfo(m.dtype).min / 2
    valid = m > lowest
    return z + torch.where(valid, m, torch.zeros((), dtype=m.dtype, device=m.device)).to(z.dtype), valid


@torch.no_grad()
def attention_head_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float,
    mask: MaskSpec,
    softcap: float | None = None,
    row_valid: torch.Tensor | None = None,
    chunk: int = 32,
    dtype: torch.dtype = torch.float32,
) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor]:
    """Per-head sums and row counts of every attention statistic.

    Args:
        query: (B, H, Tq, D); key: (B, Hkv, Tk, D) with H a multiple of Hkv.
        row_valid: bool (B, Tq): query rows to count (False for padding queries).
        dtype: precision of the logits and statistics (float64 for exact checks).

    Returns:
        (metric names, sums (H, M) float64, counts (H, M) float64).
    """
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    k = key.to(dtype)
    sums = torch.zeros(h, len(ATTN_METRICS), dtype=torch.float64, device=query.device)
    counts = torch.zeros_like(sums)
    for i0 in range(0, tq, chunk):
        i1 = min(tq, i0 + chunk)
        # Causal structure without a mask: keys past the last query of the chunk are never used.
        kk = k
        if mask.mask is None and mask.causal:
            kk = k[:, :, : min(tk, i1 + mask.q_offset)]
        z = _chunk_logits(query[:, :, i0:i1].to(dtype), kk, scaling, softcap)  # (B, H, C, Tk')
        z, valid = _chunk_valid(mask, i0, i1, kk.shape[2], query.device, z)
        rv = None if row_valid is None else row_valid[:, i0:i1].bool().view(b, 1, i1 - i0)
        stats = row_stats(z, valid, rv, first_key=True)
        for m, name in enumerate(ATTN_METRICS):
            v = stats.values[name].to(torch.float64)  # (B, H, C)
            w = stats.weight[name].to(torch.float64)
            sums[:, m] += (v * w).sum(dim=(0, 2))
            counts[:, m] += w.sum(dim=(0, 2))
    return ATTN_METRICS, sums, counts
