"""Per-row key ranges: which keys each query row may attend to, as one interval [start, end).

The fused kernel reads no mask: each row's visible keys are the interval [start, end) of key
positions, which covers causal attention (end = q + q_offset + 1), left and right padding, a
sliding window (start = q + q_offset - window + 1) and packed documents (start = the first key
of the row's document). ``key_ranges`` computes them from a ``MaskSpec`` on the device, with no
host synchronisation: structure given by index becomes arithmetic on positions; a mask tensor
(bool or additive, one mask for all heads) becomes its first and last visible key per row, and
``RangeCheck.broken`` counts the rows whose visible keys are not one interval (a mask the ranges
cannot express; the caller reads it once per batch and falls back to the torch path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import MaskSpec


@dataclass
class KeyRanges:
    """start, end: int32 (B|1, Tq); a row with start >= end sees no key. ``broken``: int64
    scalar tensor, the rows whose mask is not one interval (0 for structure given by index)."""

    start: torch.Tensor
    end: torch.Tensor
    broken: torch.Tensor


def ranges_supported(spec: MaskSpec, n_heads: int) -> bool:
    """Whether ``key_ranges`` can express ``spec`` without looking at values (host-only): one
    mask for every head (a per-head mask needs per-head ranges)."""
    return spec.mask is None or (spec.mask.dim() == 4 and spec.mask.shape[1] == 1)


def cu_seq_starts(cu_seq_lens: torch.Tensor, t: int) -> torch.Tensor:
    """(1, T) int64: each position's document start from ``cu_seq_lens`` (cumulative document
    lengths, 0 first), as flash attention's varlen path receives them for a batch of one row."""
    pos = torch.arange(t, device=cu_seq_lens.device)
    doc = torch.searchsorted(cu_seq_lens[1:].to(pos.dtype), pos, right=True)  # the document of each
    return cu_seq_lens.to(pos.dtype)[doc].view(1, t)


def key_ranges(spec: MaskSpec, b: int, tq: int, tk: int, device: torch.device,
               doc_start: torch.Tensor | None = None) -> KeyRanges:
    """Each query row's visible keys [start, end) for a mask ``spec`` over ``tk`` keys;
    ``doc_start`` (B|1, Tq): the first key of each row's document (packed documents).
    ``ranges_supported(spec, H)`` must hold."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    if spec.mask is None:
        q = torch.arange(tq, device=device).view(1, tq) + spec.q_offset  # (1, Tq) key position
        end = (q + 1).clamp(max=tk) if spec.causal else torch.full_like(q, tk)
        start = torch.zeros_like(q)
        if spec.sliding_window is not None:
            start = (q - spec.sliding_window + 1).clamp(min=0)
        broken = zero
    else:
        m = spec.mask[:, 0, :tq, :tk]  # (B|1, Tq, Tk)
        valid = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        count = valid.sum(-1)  # (B|1, Tq)
        first = valid.to(torch.int8).argmax(-1)
        last = tk - valid.flip(-1).to(torch.int8).argmax(-1)
        start = torch.where(count > 0, first, zero)
        end = torch.where(count > 0, last, zero)
        broken = ((count > 0) & (end - start != count)).sum()
    if doc_start is not None:
        start = torch.maximum(start, doc_start.to(start.dtype))
    start, end = torch.broadcast_tensors(start, end)
    return KeyRanges(start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous(), broken)


def ranges_mask(r: KeyRanges, tk: int) -> torch.Tensor:
    """(B|1, 1, Tq, Tk) bool: the dense mask of the ranges (for the torch path and the tests)."""
    k = torch.arange(tk, device=r.start.device).view(1, 1, tk)
    return ((k >= r.start.unsqueeze(-1)) & (k < r.end.unsqueeze(-1))).unsqueeze(1)
