"""Per-site reductions of per-row statistics (``SiteSums``) and their float64 accumulators.

A *group* is the set of sites one softmax call produces: the H heads of one attention layer,
or the single LM head. A call's rows are reduced to a ``SiteSums`` per group: per (head, metric)
the float64 sum of the row values and the number of rows, the largest logit (``vocab.LOGIT_MAX``)
and fixed-bin histograms of the rows' entropy and max-prob (``vocab.QUANTILE_OF``). The
``Accumulator`` adds ``SiteSums`` up (sums, counts and histograms by addition, the largest logit
by max), so batches, processes and shards merge exactly; the final value of a row statistic is
the equal-weight mean over rows, and the quantiles are read off the merged histograms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .. import vocab
from .rows import RowStats

_F64 = torch.float64


@dataclass(frozen=True, order=True)
class SiteGroup:
    """One softmax call site: ``kind`` is ``attn`` or ``lm_head``; ``layer`` is -1 for the LM head."""

    kind: str
    layer: int


@dataclass
class SiteSums:
    """What one call adds for one group of H sites (tensors float64, on the call's device).

    names: the row statistics, in emission order; sums (H, M): their sums over the kept rows;
    counts (H, M): the rows each was defined on; maxima (H,): the largest logit over the kept
    rows (``vocab.LOGIT_MAX``; -inf where none); hist (H, Q, ``vocab.HIST_BINS``): row counts
    per bin of each statistic of ``vocab.QUANTILE_OF``; load (E,): routers only, the top-k
    assignments each expert received (``vocab.LOAD_METRICS`` are read off it), else None."""

    names: tuple[str, ...]
    sums: torch.Tensor
    counts: torch.Tensor
    maxima: torch.Tensor
    hist: torch.Tensor
    load: torch.Tensor | None = None


def hist_index(x: torch.Tensor, name: str) -> torch.Tensor:
    """The histogram bin (int64) of each value of row statistic ``name``: uniform bins over
    ``vocab.HIST_RANGE[name]``, values outside (and NaN) clamped into the end bins."""
    lo, hi = vocab.HIST_RANGE[name]
    scaled = ((x.to(_F64) - lo) * (vocab.HIST_BINS / (hi - lo))).nan_to_num(0.0)
    return scaled.floor_().clamp_(0, vocab.HIST_BINS - 1).to(torch.int64)


def reduce_rows(stats: RowStats, names: tuple[str, ...], shape: tuple[int, ...],
                head_dim: int | None) -> SiteSums:
    """``SiteSums`` of per-row ``stats`` (each broadcastable to the rows' ``shape``), reduced over
    every dimension but ``head_dim`` (None: the rows are one site); the largest logit is the
    largest ``vocab.LOGIT_ROW_MAX`` of the rows it is defined on. Values are 0 wherever their
    weight (0 or 1) is, so their plain sum is the weighted sum."""
    n_dim = len(shape)
    h = 1 if head_dim is None else shape[head_dim]

    def by_head(x: torch.Tensor) -> torch.Tensor:  # (*shape) -> (H, rows)
        x = x.expand(shape)
        return x.reshape(1, -1) if head_dim is None else x.movedim(head_dim, 0).reshape(h, -1)

    dims = [d for d in range(n_dim) if d != head_dim]
    sums = torch.stack([stats.values[n].expand(shape).sum(dim=dims) for n in names], -1)
    count: dict[int, torch.Tensor] = {}  # one count per distinct weight tensor
    for n in names:
        w = stats.weight[n]
        if id(w) not in count:
            count[id(w)] = w.expand(shape).sum(dim=dims)
    counts = torch.stack([count[id(stats.weight[n])] for n in names], -1)
    if head_dim is None:
        sums, counts = sums.reshape(1, -1), counts.reshape(1, -1)
    kept = by_head(stats.weight[vocab.LOGIT_ROW_MAX]) > 0  # (H, rows)
    ninf = torch.full((), float("-inf"), dtype=_F64, device=kept.device)
    maxima = torch.where(kept, by_head(stats.values[vocab.LOGIT_ROW_MAX].to(_F64)), ninf).amax(-1)  # (H,)
    hist = torch.zeros(h, len(vocab.QUANTILE_OF), vocab.HIST_BINS, dtype=_F64, device=kept.device)
    for i, n in enumerate(vocab.QUANTILE_OF):
        hist[:, i].scatter_add_(1, hist_index(by_head(stats.values[n]), n), by_head(stats.weight[n].to(_F64)))
    return SiteSums(tuple(names), sums.to(_F64), counts.to(_F64), maxima, hist)


def load_figures(load: np.ndarray) -> dict[str, float]:
    """``vocab.LOAD_METRICS`` of a router's per-expert assignment counts (E,): the entropy (nats)
    of the shares count / total, the fraction of experts with count 0, the largest count over
    the mean count. NaN without any assignment."""
    total = float(load.sum())
    if total <= 0:
        return {name: float("nan") for name in vocab.LOAD_METRICS}
    share = load / total
    nz = share[share > 0]
    return {vocab.LOAD_ENTROPY: float(-(nz * np.log(nz)).sum()),
            vocab.DEAD_EXPERTS: float((load == 0).mean()),
            vocab.LOAD_MAX_OVER_MEAN: float(load.max() / load.mean())}


def histogram_quantile(hist: np.ndarray, q: float, name: str) -> float:
    """Quantile ``q`` of the values binned in ``hist`` (``vocab.HIST_BINS`` counts of statistic
    ``name``), linear within the bin where the cumulative count reaches q of the total; NaN for
    an empty histogram. Within one bin width of the exact quantile of the binned values."""
    total = float(hist.sum())
    if total <= 0:
        return float("nan")
    lo, hi = vocab.HIST_RANGE[name]
    width = (hi - lo) / vocab.HIST_BINS
    cum = np.cumsum(hist)
    target = q * total
    i = int(np.searchsorted(cum, target, side="left"))
    i = min(i, len(hist) - 1)
    before = cum[i - 1] if i > 0 else 0.0
    inside = (target - before) / hist[i] if hist[i] > 0 else 0.0
    return lo + width * (i + min(max(inside, 0.0), 1.0))


class Accumulator:
    """Sums, counts, maxima and histograms (float64) per group; ``merge`` adds another one in."""

    def __init__(self) -> None:
        self._parts: dict[SiteGroup, SiteSums] = {}

    def add(self, group: SiteGroup, part: SiteSums) -> None:
        """Add one call's ``SiteSums`` for ``group`` (kept on its device until ``to_frame``)."""
        old = self._parts.get(group)
        if old is None:
            load = None if part.load is None else part.load.to(_F64).clone()
            self._parts[group] = SiteSums(part.names, part.sums.to(_F64).clone(), part.counts.to(_F64).clone(),
                                          part.maxima.to(_F64).clone(), part.hist.to(_F64).clone(), load)
            return
        if old.names != part.names or old.sums.shape != part.sums.shape:
            raise ValueError(f"inconsistent statistics for {group}: cannot merge")
        dev = old.sums.device
        old.sums += part.sums.to(dev)
        old.counts += part.counts.to(dev)
        torch.maximum(old.maxima, part.maxima.to(dev), out=old.maxima)
        old.hist += part.hist.to(dev)
        if (old.load is None) != (part.load is None) or (old.load is not None and old.load.shape != part.load.shape):
            raise ValueError(f"inconsistent expert loads for {group}: cannot merge")
        if old.load is not None:
            old.load += part.load.to(dev)

    def add_rows(self, group: SiteGroup, stats: RowStats, head_dim: int | None,
                 load: torch.Tensor | None = None) -> None:
        """Reduce per-row ``stats`` over every dimension but ``head_dim`` (None: one site) and add
        them (with a router's per-expert ``load`` counts (E,))."""
        shape = torch.broadcast_shapes(*(v.shape for v in stats.values.values()))
        part = reduce_rows(stats, tuple(stats.values), shape, head_dim)
        part.load = None if load is None else load.to(_F64)
        self.add(group, part)

    def copy(self) -> Accumulator:
        """An independent copy (its tensors cloned)."""
        out = Accumulator()
        out.merge(self)
        return out

    def merge(self, other: Accumulator) -> None:
        """Add every group of ``other`` into this accumulator."""
        for group, part in other._parts.items():
            self.add(group, part)

    def groups(self) -> list[SiteGroup]:
        return sorted(self._parts)

    def state_dict(self) -> dict:
        return {
            "groups": [
                {"kind": g.kind, "layer": g.layer, "metrics": list(p.names), "sums": p.sums.cpu(),
                 "counts": p.counts.cpu(), "maxima": p.maxima.cpu(), "hist": p.hist.cpu(),
                 "load": None if p.load is None else p.load.cpu()}
                for g, p in sorted(self._parts.items())
            ]
        }

    def load_state_dict(self, state: dict) -> None:
        self._parts.clear()
        for item in state["groups"]:
            group = SiteGroup(item["kind"], int(item["layer"]))
            self.add(group, SiteSums(tuple(item["metrics"]), item["sums"], item["counts"],
                                     item["maxima"], item["hist"], item.get("load")))

    def to_frame(self) -> pd.DataFrame:
        """Tidy per-site values: columns site_kind, layer, head, metric, value, n_rows (sorted).
        Row statistics are means over rows; ``vocab.SITE_METRICS`` are the largest logit and the
        histogram quantiles, each with the number of rows it was taken over; a router adds
        ``vocab.LOAD_METRICS`` over the tokens it routed."""
        rows = []
        for g in self.groups():
            p = self._parts[g]
            sums, counts = p.sums.cpu().numpy(), p.counts.cpu().numpy()  # (H, M)
            maxima, hist = p.maxima.cpu().numpy(), p.hist.cpu().numpy()  # (H,), (H, Q, bins)
            n_max = counts[:, p.names.index(vocab.LOGIT_ROW_MAX)]
            if p.load is not None:
                n_tok = int(round(float(counts[0, p.names.index(vocab.TOPK_MASS)])))
                for name, value in load_figures(p.load.cpu().numpy()).items():
                    rows.append((g.kind, g.layer, -1, name, value, n_tok))
            for h in range(sums.shape[0]):
                head = -1 if g.kind in (vocab.LM_HEAD, vocab.ROUTER) else h
                for m, name in enumerate(p.names):
                    c = float(counts[h, m])
                    rows.append((g.kind, g.layer, head, name, sums[h, m] / c if c > 0 else float("nan"),
                                 int(round(c))))
                top = float(maxima[h]) if n_max[h] > 0 else float("nan")
                rows.append((g.kind, g.layer, head, vocab.LOGIT_MAX, top, int(round(float(n_max[h])))))
                for i, name in enumerate(vocab.QUANTILE_OF):
                    n_hist = int(round(float(hist[h, i].sum())))
                    for q in vocab.QUANTILES:
                        value = histogram_quantile(hist[h, i], q, name)
                        rows.append((g.kind, g.layer, head, vocab.quantile_metric(name, q), value, n_hist))
        df = pd.DataFrame(rows, columns=["site_kind", "layer", "head", "metric", "value", "n_rows"])
        return df.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(
            drop=True
        )
