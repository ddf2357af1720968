"""The setting every law of the linear-attention toy shares, as one record.

Each law's own sizes, steps and seeds live beside its experiment (``sweep.QUICK``/``FULL``,
``data.DATA_QUICK``/``DATA_FULL``, ``context.CONTEXT_QUICK``/``CONTEXT_FULL``); what they
leave out is taken from ``DEFAULT``. The setting is described in docs/linear_attention.md,
section 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT", "LinearAttentionConfig"]


@dataclass(frozen=True)
class LinearAttentionConfig:
    """K = ``n_features`` tasks with p_k ~ k^-(1+``zipf_a``); ``context`` tokens per sequence;
    SGD on fresh batches of ``batch`` sequences at learning rate ``lr``; W_K, W_Q entries
    N(0, ``init_scale``^2 / M), drawn independently (``init="independent"``) or with W_Q = W_K
    (``"balanced"``); loss curves averaged over ``n_bins`` log-spaced step bins."""

    n_features: int = 4096
    zipf_a: float = 0.8
    context: float = 32
    batch: int = 512
    lr: float = 1.0
    init_scale: float = 0.1
    init: str = "independent"
    n_bins: int = 40


DEFAULT = LinearAttentionConfig()
