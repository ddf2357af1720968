"""Mergeable float64 accumulators of per-row statistics, one group of sites at a time.

A *group* is the set of sites one softmax call produces: the H heads of one attention layer,
or the single LM head. The accumulator keeps, per (group, head, metric), the float64 sum of the
row values and the number of rows, so batches, processes and shards merge exactly and the final
value is the equal-weight mean over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from .rows import RowStats


@dataclass(frozen=True, order=True)
class SiteGroup:
    """One softmax call site: ``kind`` is ``attn`` or ``lm_head``; ``layer`` is -1 for the LM head."""

    kind: str
    layer: int


class Accumulator:
    """Sums and counts (float64) per (group, head, metric); ``merge`` adds another one in."""

    def __init__(self) -> None:
        self._metrics: dict[SiteGroup, tuple[str, ...]] = {}
        self._sums: dict[SiteGroup, torch.Tensor] = {}  # (H, M) float64
        self._counts: dict[SiteGroup, torch.Tensor] = {}  # (H, M) float64

    def add_sums(
        self, group: SiteGroup, metrics: tuple[str, ...], sums: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """Add already-reduced ``sums`` and ``counts`` of shape (H, M) for ``group``."""
        sums = sums.to(torch.float64)
        counts = counts.to(torch.float64)
        if group not in self._sums:
            self._metrics[group] = tuple(metrics)
            self._sums[group] = sums.clone()
            self._counts[group] = counts.clone()
            return
        if self._metrics[group] != tuple(metrics) or self._sums[group].shape != sums.shape:
            raise ValueError(f"inconsistent statistics for {group}: cannot merge")
        self._sums[group] += sums.to(self._sums[group].device)
        self._counts[group] += counts.to(self._counts[group].device)

    def add_rows(self, group: SiteGroup, stats: RowStats, head_dim: int | None) -> None:
        """Reduce per-row ``stats`` over every dimension but ``head_dim`` (None: one site)."""
        metrics = tuple(stats.values)
        sums, counts = [], []
        for name in metrics:
            v = stats.values[name].to(torch.float64)
            w = stats.weight[name].to(torch.float64).expand_as(v)
            if head_dim is None:
                sums.append((v * w).sum().reshape(1))
                counts.append(w.sum().reshape(1))
            else:
                dims = [d for d in range(v.dim()) if d != head_dim]
                sums.append((v * w).sum(dim=dims))
                counts.append(w.sum(dim=dims))
        self.add_sums(group, metrics, torch.stack(sums, -1), torch.stack(counts, -1))

    def merge(self, other: Accumulator) -> None:
        """Add every group of ``other`` into this accumulator."""
        for group in other._sums:
            self.add_sums(group, other._metrics[group], other._sums[group], other._counts[group])

    def groups(self) -> list[SiteGroup]:
        return sorted(self._sums)

    def state_dict(self) -> dict:
        return {
            "groups": [
                {
                    "kind": g.kind,
                    "layer": g.layer,
                    "metrics": list(self._metrics[g]),
                    "sums": self._sums[g].cpu(),
                    "counts": self._counts[g].cpu(),
                }
                for g in self.groups()
            ]
        }

    def load_state_dict(self, state: dict) -> None:
        self._metrics.clear()
        self._sums.clear()
        self._counts.clear()
        for item in state["groups"]:
            group = SiteGroup(item["kind"], int(item["layer"]))
            self.add_sums(group, tuple(item["metrics"]), item["sums"], item["counts"])

    def to_frame(self) -> pd.DataFrame:
        """Tidy means: columns site_kind, layer, head, metric, value, n_rows (sorted)."""
        rows = []
        for g in self.groups():
            sums = self._sums[g].cpu().double()
            counts = self._counts[g].cpu().double()
            n_heads = sums.shape[0]
            for h in range(n_heads):
                head = -1 if g.kind == "lm_head" else h
                for m, name in enumerate(self._metrics[g]):
                    c = counts[h, m].item()
                    value = sums[h, m].item() / c if c > 0 else float("nan")
                    rows.append((g.kind, g.layer, head, name, value, int(round(c))))
        df = pd.DataFrame(rows, columns=["site_kind", "layer", "head", "metric", "value", "n_rows"])
        return df.sort_values(["site_kind", "layer", "head", "metric"], kind="stable").reset_index(
            drop=True
        )
