"""Per-row statistics of a block of softmax logits (pure torch; the reference path).

A *row* is one softmax: the logits ``z`` of one query over the keys it may attend to, or of one
token position over the vocabulary. Given a block of rows and a validity mask this module returns
every statistic of DESIGN.md ("The softmax site") per row, exactly and in the block's dtype.
Nothing here knows about models or hooks; `hooks` feeds it, `accumulate` averages its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Statistics every softmax site reports, in this order.
COMMON_METRICS: tuple[str, ...] = (
    "entropy",
    "entropy_norm",
    "max_prob",
    "logit_std",
    "logit_max_minus_mean",
    "logit_top_gap",
    "peaked",
)
#: Attention sites add the probability on the first visible key (the attention-sink mass).
ATTN_METRICS: tuple[str, ...] = COMMON_METRICS + ("first_key_prob",)
#: The LM head adds the next-token statistics.
LM_METRICS: tuple[str, ...] = COMMON_METRICS + ("loss", "target_prob", "target_logit_minus_mean")


@dataclass
class RowStats:
    """Per-row statistics of one block. Every field has the block's row shape ``R`` (any shape).

    ``weight[name]`` is 1.0 where that statistic is defined for the row and 0.0 elsewhere
    (invalid rows; rows with one option for ``entropy_norm`` and ``logit_top_gap``).
    """

    values: dict[str, torch.Tensor]
    weight: dict[str, torch.Tensor]


def peaked_threshold(n: torch.Tensor) -> torch.Tensor:
    """The random-energy-model threshold sqrt(2 ln n) on the logit std, per row."""
    return torch.sqrt(2.0 * torch.log(n.clamp(min=1)))


def row_stats(
    z: torch.Tensor,
    valid: torch.Tensor,
    row_valid: torch.Tensor | None = None,
    *,
    first_key: bool = False,
    target: torch.Tensor | None = None,
) -> RowStats:
    """Statistics of each row of ``z`` over the options where ``valid`` is True.

    Args:
        z: logits, shape ``(*R, N)`` (N options per row), already scaled/softcapped as the
            model does; the computation runs in ``z.dtype``.
        valid: bool, broadcastable to ``z``: which options the row may use (masks applied).
        row_valid: bool, broadcastable to ``R``: rows to keep (e.g. not a padding query).
            Rows with no valid option are always dropped.
        first_key: also report ``first_key_prob``, the probability on the row's first valid
            option (the first real token in a left-padded batch).
        target: int64 of shape ``R``: index of the next token, to report ``loss``,
            ``target_prob`` and ``target_logit_minus_mean`` (LM head).
    """
    valid = valid.expand_as(z)
    n = valid.sum(-1)  # (*R,)
    ok = n > 0
    if row_valid is not None:
        ok = ok & row_valid.expand_as(ok)
    nf = n.to(z.dtype).clamp(min=1)
    neg_inf = torch.tensor(float("-inf"), dtype=z.dtype, device=z.device)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)

    z_masked = torch.where(valid, z, neg_inf)  # (*R, N)
    top2 = z_masked.topk(min(2, z.shape[-1]), dim=-1).values  # (*R, 2)
    zmax = torch.where(ok, top2[..., 0], zero)  # (*R,)
    e = torch.exp(z_masked - zmax.unsqueeze(-1))  # (*R, N), 0 where invalid
    s = e.sum(-1).clamp(min=torch.finfo(z.dtype).tiny)  # (*R,)
    p = e / s.unsqueeze(-1)
    z_zeroed = torch.where(valid, z, zero)
    mean = z_zeroed.sum(-1) / nf
    centered = torch.where(valid, z - mean.unsqueeze(-1), zero)
    std = torch.sqrt((centered * centered).sum(-1) / nf)
    lse = zmax + torch.log(s)
    entropy = lse - (p * z_zeroed).sum(-1)
    log_n = torch.log(nf)
    two_plus = ok & (n > 1)

    values = {
        "entropy": entropy,
        "entropy_norm": entropy / torch.where(two_plus, log_n, torch.ones_like(log_n)),
        "max_prob": 1.0 / s,
        "logit_std": std,
        "logit_max_minus_mean": zmax - mean,
        "logit_top_gap": (top2[..., 0] - top2[..., -1]) if z.shape[-1] > 1 else torch.zeros_like(zmax),
        "peaked": (std > peaked_threshold(nf)).to(z.dtype),
    }
    okf = ok.to(z.dtype)
    twof = two_plus.to(z.dtype)
    weight = {name: okf for name in values}
    weight["entropy_norm"] = twof
    weight["logit_top_gap"] = twof
    if first_key:
        idx = valid.to(torch.int8).argmax(-1, keepdim=True)  # first True per row
        values["first_key_prob"] = p.gather(-1, idx).squeeze(-1)
        weight["first_key_prob"] = okf
    if target is not None:
        t = target.clamp(min=0).unsqueeze(-1)
        z_t = z.gather(-1, t).squeeze(-1)
        loss = lse - z_t
        values["loss"] = loss
        values["target_prob"] = torch.exp(-loss)
        values["target_logit_minus_mean"] = z_t - mean
        tgt_ok = okf * (target >= 0).to(z.dtype)
        for name in ("loss", "target_prob", "target_logit_minus_mean"):
            weight[name] = tgt_ok
    # Zero out undefined entries so that NaN/inf never leak into sums.
    for name, v in values.items():
        values[name] = torch.where(weight[name] > 0, v, zero)
    return RowStats(values=values, weight=weight)


def threshold_for(n: int) -> float:
    """sqrt(2 ln n) for a plain integer number of options."""
    return math.sqrt(2.0 * math.log(n)) if n > 1 else 0.0
