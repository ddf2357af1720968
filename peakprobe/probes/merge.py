"""Merging ``Accumulator``s across processes: every group packed into one flat float64 tensor
per reduce op, so a probe merges with one all-reduce per op whatever the model's size.

Sums, counts and histograms add (``SUM``); the largest logits take the max (``MAX``). A
process that holds only some of a group's heads (tensor parallel: each rank computes its local
heads) places them at their global offset in a tensor of the global head count, zeros (for
``SUM``) and -inf (for ``MAX``) elsewhere, so the merged accumulator is indexed like the unsharded
model's. A process that must not count a group (a replica of what another rank already counts)
contributes zeros and -inf. The reduction itself is a callable handed in (the process-group
glue lives in ``integrations``): probes import torch only.

The per-row ``Sums`` of a softmax whose options are split across processes (a vocab-parallel LM
head) merge exactly with ``sums.merge``: ``merge_row_parts`` combines the parts' maxima and
log-sum-exps (lse = m + log sum_r exp(lse_r - m)), never an average of their statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import vocab
from .accumulate import Accumulator, SiteGroup, SiteSums
from .sums import Sums, merge

_F64 = torch.float64
SUM = "sum"
MAX = "max"
#: (this rank's first head in the group's global heads, the group's global head count), or
#: None where this rank contributes nothing to the group
Placement = tuple[int, int] | None


@dataclass(frozen=True)
class Slot:
    """Where one group lies in the packed tensors: its global head count and metric names."""

    group: SiteGroup
    names: tuple[str, ...]
    heads: int


def _placed(part: SiteSums, place: Placement, heads: int) -> SiteSums:
    """``part``'s tensors in a tensor of ``heads`` global heads at ``place``'s offset (zeros and
    -inf elsewhere; all of it where ``place`` is None)."""
    local = part.sums.shape[0]
    m, q, b = part.sums.shape[1], part.hist.shape[1], part.hist.shape[2]
    dev = part.sums.device
    sums = torch.zeros(heads, m, dtype=_F64, device=dev)
    counts = torch.zeros(heads, m, dtype=_F64, device=dev)
    maxima = torch.full((heads,), float("-inf"), dtype=_F64, device=dev)
    hist = torch.zeros(heads, q, b, dtype=_F64, device=dev)
    if place is not None:
        lo = place[0]
        sums[lo : lo + local] = part.sums
        counts[lo : lo + local] = part.counts
        maxima[lo : lo + local] = part.maxima
        hist[lo : lo + local] = part.hist
    return SiteSums(part.names, sums, counts, maxima, hist)


def pack(acc: Accumulator, place: Callable[[SiteGroup, int], Placement] | None = None,
         extra: torch.Tensor | None = None) -> tuple[list[Slot], torch.Tensor, torch.Tensor]:
    """(slots, the SUM tensor, the MAX tensor) of every group of ``acc``, in group order.

    ``place(group, local_heads)`` gives this rank's heads' offset and the global head count
    (default: all heads, offset 0). ``extra`` (float64, 1-D) is appended to the SUM tensor
    (flags the caller reduces along with the sums)."""
    slots, to_sum, to_max = [], [], []
    for group in acc.groups():
        part = acc._parts[group]
        local = part.sums.shape[0]
        where = (0, local) if place is None else place(group, local)
        heads = local if where is None else where[1]
        if where is not None and where[0] + local > heads:
            raise ValueError(f"{group}: heads {where[0]}..{where[0] + local - 1} outside {heads} global heads")
        full = _placed(part, where, heads) if (where is None or where != (0, local)) else part
        slots.append(Slot(group, part.names, heads))
        to_sum += [full.sums.reshape(-1), full.counts.reshape(-1), full.hist.reshape(-1)]
        to_max.append(full.maxima.reshape(-1))
    if extra is not None:
        to_sum.append(extra.to(_F64).reshape(-1))
    dev = to_sum[0].device if to_sum else torch.device("cpu")
    flat_sum = torch.cat([t.to(dev) for t in to_sum]) if to_sum else torch.zeros(0, dtype=_F64)
    flat_max = torch.cat([t.to(dev) for t in to_max]) if to_max else torch.zeros(0, dtype=_F64)
    return slots, flat_sum, flat_max


def unpack(slots: Sequence[Slot], flat_sum: torch.Tensor, flat_max: torch.Tensor
           ) -> tuple[Accumulator, torch.Tensor]:
    """The accumulator the packed tensors hold (inverse of ``pack``), and what of the SUM
    tensor follows the groups (``pack``'s ``extra``, reduced)."""
    acc = Accumulator()
    i = j = 0
    q, bins = len(vocab.QUANTILE_OF), vocab.HIST_BINS
    for slot in slots:
        h, m = slot.heads, len(slot.names)
        sums = flat_sum[i : i + h * m].reshape(h, m)
        counts = flat_sum[i + h * m : i + 2 * h * m].reshape(h, m)
        i += 2 * h * m
        hist = flat_sum[i : i + h * q * bins].reshape(h, q, bins)
        i += h * q * bins
        maxima = flat_max[j : j + h]
        j += h
        acc.add(slot.group, SiteSums(slot.names, sums, counts, maxima, hist))
    return acc, flat_sum[i:]


def reduce_accumulator(acc: Accumulator, all_reduce: Callable[[torch.Tensor, str], None], *,
                       place: Callable[[SiteGroup, int], Placement] | None = None,
                       extra: torch.Tensor | None = None) -> tuple[Accumulator, torch.Tensor]:
    """The accumulator merged over every process, and ``extra`` summed over them:
    ``all_reduce(tensor, op)`` reduces a flat tensor in place, once with ``SUM`` and once with
    ``MAX`` (every process must hold the same groups, as the same model's calls give)."""
    slots, flat_sum, flat_max = pack(acc, place, extra)
    all_reduce(flat_sum, SUM)
    all_reduce(flat_max, MAX)
    return unpack(slots, flat_sum, flat_max)


#: one per-layer table's layout in a packed tensor: (layer, global heads, columns)
LayerSlot = tuple[int, int, int]


def pack_layers(parts: dict[int, torch.Tensor], place: Callable[[SiteGroup, int], Placement] | None = None,
                ) -> tuple[list[LayerSlot], torch.Tensor]:
    """Per-layer per-head sums (layer -> (H_local, W), like the query-key geometry or the role
    scores) as (slots, one flat float64 tensor to ``SUM``), each layer's heads at ``place``'s
    offset (zeros elsewhere; all zeros where ``place`` gives None), in layer order; on the CPU
    (a failed call's zero placeholders live there, the measured tables on the device)."""
    slots, flat = [], []
    for layer, local in sorted(parts.items()):
        h, w = local.shape
        where = (0, h) if place is None else place(SiteGroup(vocab.ATTN, layer), h)
        heads = h if where is None else where[1]
        full = torch.zeros(heads, w, dtype=_F64, device=local.device)
        if where is not None:
            full[where[0] : where[0] + h] = local.to(_F64)
        slots.append((layer, heads, w))
        flat.append(full.reshape(-1).cpu())
    return slots, (torch.cat(flat) if flat else torch.zeros(0, dtype=_F64))


def unpack_layers(slots: Sequence[LayerSlot], flat: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The per-layer tables ``pack_layers`` packed (reduced), and what of ``flat`` follows them."""
    out, i = {}, 0
    for layer, heads, w in slots:
        out[layer] = flat[i : i + heads * w].reshape(heads, w)
        i += heads * w
    return out, flat[i:]


def zeros_like(acc: Accumulator) -> Accumulator:
    """An accumulator with ``acc``'s groups and nothing in them (zero rows, no maxima)."""
    out = Accumulator()
    for group in acc.groups():
        p = acc._parts[group]
        out.add(group, SiteSums(p.names, torch.zeros_like(p.sums), torch.zeros_like(p.counts),
                                torch.full_like(p.maxima, float("-inf")), torch.zeros_like(p.hist)))
    return out


FIELDS = tuple(Sums.__dataclass_fields__)


def stack_sums(s: Sums) -> torch.Tensor:
    """(7, *rows) float64: a ``Sums``' fields stacked (for one collective)."""
    return torch.stack([getattr(s, f).to(_F64).expand_as(s.m) for f in FIELDS])


def merge_row_parts(parts: Sequence[torch.Tensor]) -> Sums:
    """The ``Sums`` of whole rows from ``stack_sums`` of their disjoint option parts (one per
    vocabulary shard): maxima and log-sum-exps combined exactly by ``sums.merge``."""
    out = Sums(*parts[0])
    for p in parts[1:]:
        out = merge(out, Sums(*p))
    return out
