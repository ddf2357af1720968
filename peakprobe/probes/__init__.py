"""Streaming per-row statistics of softmax logits and their mergeable accumulators (torch only)."""

from .accumulate import Accumulator, SiteGroup
from .attention import MaskSpec, attention_head_sums
from .rows import ATTN_METRICS, COMMON_METRICS, LM_METRICS, RowStats, peaked_threshold, row_stats

__all__ = [
    "ATTN_METRICS",
    "COMMON_METRICS",
    "LM_METRICS",
    "Accumulator",
    "MaskSpec",
    "RowStats",
    "SiteGroup",
    "attention_head_sums",
    "peaked_threshold",
    "row_stats",
]
