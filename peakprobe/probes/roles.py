"""Head-role scores on the diagnostic batch of repeated random tokens (pure torch).

The batch is ``vocab.ROLE_SEQUENCES`` sequences [x_1..x_n, x_1..x_n] of random tokens
(``diagnostic_batch``, fixed seed). For the query at position q each role names one key
(``role_targets``): the previous-token role q - 1 (every row but the first); on the second copy
(q = n + i, 0-based i) the duplicate-token role the earlier copy i and the induction role the
key after it, i + 1. A head's score for a role is its attention probability on that key,
averaged over the rows where the role names one (``vocab.ROLE_METRICS``).

The probability comes from the head's logits block by block (query rows x keys, never T x T):
the row's log-partition over its visible keys (causal / window structure, a bool or additive
mask, an additive position bias, softcapping, a learned sink logit) and the target key's logit.
"""

from __future__ import annotations

import torch

from .. import vocab
from .attention import MaskSpec, _chunk_logits, _index_valid


def diagnostic_batch(vocab_size: int, max_positions: int | None = None, *,
                     sequences: int = vocab.ROLE_SEQUENCES, period: int = vocab.ROLE_PERIOD,
                     seed: int = vocab.ROLE_SEED, low: int = 3) -> tuple[torch.Tensor, int]:
    """(ids (sequences, 2n) int64, n): random tokens in [low, vocab_size) repeated once; n is
    ``period``, halved to fit ``max_positions``."""
    n = period if max_positions is None else max(2, min(period, int(max_positions) // 2))
    low = min(low, max(0, vocab_size - 2))
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(low, vocab_size, (sequences, n), generator=g)
    return torch.cat([half, half], 1), n


def role_targets(t: int, n: int, device=None) -> torch.Tensor:
    """(R, t) int64 target key of each query row per role of ``vocab.ROLE_METRICS`` (-1: none)."""
    q = torch.arange(t, device=device)
    second = (q >= n) & (q < 2 * n)
    none = torch.full_like(q, -1)
    out = {
        vocab.INDUCTION_SCORE: torch.where(second, q - n + 1, none),
        vocab.PREV_TOKEN_SCORE: torch.where(q >= 1, q - 1, none),
        vocab.DUPLICATE_SCORE: torch.where(second, q - n, none),
    }
    return torch.stack([out[m] for m in vocab.ROLE_METRICS])


def role_sums(query: torch.Tensor, key: torch.Tensor, targets: torch.Tensor, *, spec: MaskSpec,
              scaling: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
              position_bias: torch.Tensor | None = None, chunk: int = 32,
              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums (H, R), counts (H, R)) float64 of the attention probability each head puts on each
    role's target key, over the rows (B x Tq) where the target is visible. query (B, H, Tq, D),
    key (B, Hkv, Tk, D), targets (R, Tq) key index or -1."""
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    r = targets.shape[0]
    sums = torch.zeros(h, r, dtype=torch.float64, device=query.device)
    counts = torch.zeros(h, r, dtype=torch.float64, device=query.device)
    k = key.to(dtype)
    for i0 in range(0, tq, chunk):
        i1 = min(tq, i0 + chunk)
        z = _chunk_logits(query[:, :, i0:i1].to(dtype), k, scaling, softcap)  # (B, H, C, Tk)
        if position_bias is not None:
            z = z + position_bias[..., i0:i1, :].to(dtype)
        valid = _index_valid(spec, i0, i1, 0, tk, z.device)  # (1, 1, C, Tk)
        if spec.mask is not None:
            m = spec.mask[..., i0:i1, :]
            if m.dtype == torch.bool:
                valid = valid & m
            else:
                z = z + m.to(dtype)
                valid = valid & (m > torch.finfo(m.dtype).min / 2)
        valid = valid.expand_as(z)
        z = z.masked_fill(~valid, float("-inf"))
        lse = torch.logsumexp(z, -1)  # (B, H, C)
        if sinks is not None:
            s = sinks.to(dtype)
            s = s.view(1, h, 1) if s.dim() == 1 else s[..., i0:i1, 0]
            lse = torch.logaddexp(lse, s.expand_as(lse))
        tgt = targets[:, i0:i1].to(z.device)  # (R, C)
        for j in range(r):
            t = tgt[j].clamp(min=0).view(1, 1, -1, 1).expand(b, h, -1, 1)
            seen = valid.gather(-1, t)[..., 0] & (tgt[j] >= 0).view(1, 1, -1) & torch.isfinite(lse)
            p = (z.gather(-1, t)[..., 0] - lse).exp()  # (B, H, C)
            sums[:, j] += torch.where(seen, p, torch.zeros_like(p)).to(torch.float64).sum((0, 2))
            counts[:, j] += seen.to(torch.float64).sum((0, 2))
    return sums, counts
