"""Per-token statistics of a mixture-of-experts router's softmax over its experts (pure torch).

A router row is one token's logits over the layer's E experts. The common statistics (entropy,
max prob, logit std, logit max, peakedness, beta_eff, ...) come from the same sums as every
other softmax (``rows.block_sums`` and ``rows.finish``); a router adds the probability mass of
its top-k experts (``vocab.TOPK_MASS``) and the per-expert count of top-k assignments, from
which ``accumulate.load_figures`` reads the load-balance figures. Rows are few (one per token)
and narrow (E options), so a router's logits are reduced in one block.
"""

from __future__ import annotations

import torch

from .. import vocab
from .rows import RowStats, block_sums, finish


def router_row_stats(logits: torch.Tensor, kept: torch.Tensor, top_k: int,
                     dtype: torch.dtype = torch.float64) -> tuple[RowStats, torch.Tensor]:
    """(per-token ``RowStats`` (N,), per-expert top-k assignment counts (E,) float64) of router
    ``logits`` (N, E) over the ``kept`` (N,) bool tokens, computed in ``dtype``.

    The top-k experts are the k largest logits (the k most probable experts: softmax is
    monotone); ``topk_mass`` is their total probability under the full softmax."""
    n, e = logits.shape
    k = max(1, min(int(top_k), e))
    z = logits.detach().to(dtype)  # (N, E)
    kept = kept.to(z.device).bool()
    stats = finish(block_sums(z), kept, n_max=e)
    lse = torch.logsumexp(z.to(torch.float64), dim=-1, keepdim=True)  # (N, 1)
    top = z.topk(k, dim=-1)  # values, indices (N, k)
    mass = (top.values.to(torch.float64) - lse).exp().sum(-1)  # (N,)
    okf = (kept & (torch.isfinite(z).any(-1))).to(torch.float64)
    stats.values[vocab.TOPK_MASS] = torch.where(okf > 0, mass, torch.zeros_like(mass))
    stats.weight[vocab.TOPK_MASS] = okf
    load = torch.zeros(e, dtype=torch.float64, device=z.device)
    load.scatter_add_(0, top.indices.reshape(-1), okf[:, None].expand(n, k).reshape(-1))
    return stats, load
