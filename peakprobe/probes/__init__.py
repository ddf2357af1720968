"""Streaming per-row statistics of softmax logits and their mergeable accumulators (torch only)."""

from .accumulate import Accumulator, SiteGroup
from .attention import MaskSpec, attention_forward_with_sums, attention_head_sums
from .gaussian_entropy import beta_eff, expected_entropy
from .rows import RowStats, attn_metric_names, row_stats

__all__ = [
    "Accumulator",
    "MaskSpec",
    "RowStats",
    "SiteGroup",
    "attention_forward_with_sums",
    "attention_head_sums",
    "attn_metric_names",
    "beta_eff",
    "expected_entropy",
    "row_stats",
]
