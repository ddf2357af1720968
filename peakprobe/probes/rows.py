"""Per-row statistics of softmax logits, derived from a few streaming sums (pure torch).

A *row* is one softmax: the logits ``z`` of one query over the keys it may attend to, or of one
token position over the vocabulary. Each block of logits is reduced once to per-row sums
(``sums.Sums``: count, max, second max, sum e^(z-m), sum e^(z-m)(z-m), sum (z-m), sum (z-m)^2),
parts of a row (key ranges, the first visible key, a learned sink logit) are merged exactly
(``sums``), and every statistic is derived from the merged sums in float64 (``finish``).
Metric names come from ``vocab``. Nothing here knows about models or hooks; ``attention`` and
the hooks feed it, ``accumulate`` averages its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import vocab
from .gaussian_entropy import Counts, beta_eff, counts
from .sums import Sums, merge_one, normalized
from .workspace import Workspace, take


def attn_metric_names(sinks: bool = False) -> tuple[str, ...]:
    """Every attention statistic, in emission order (``sink_prob`` last, for sink models)."""
    return vocab.ATTN_PROBE_METRICS + ((vocab.SINK_PROB,) if sinks else ())


@dataclass
class RowStats:
    """Per-row statistics of one block. Every field has the block's row shape ``R`` (any shape).

    ``weight[name]`` is 1.0 where that statistic is defined for the row and 0.0 elsewhere
    (invalid rows; rows with one option for ``entropy_norm`` and ``logit_top_gap``).
    """

    values: dict[str, torch.Tensor]
    weight: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Tail:
    """Which of a block's last W options each row sees (every row sees the others), with the
    additive masks ``_fast_sums`` applies: built once per shape, reused by every such block."""

    valid: torch.Tensor  # bool (..., W)
    seen: torch.Tensor  # (...,) how many of the W each row sees (x's dtype)
    hide: torch.Tensor  # (..., W) 0 where seen, -1e30 where hidden
    to_clamp: torch.Tensor  # (..., W) 0 where seen, the exp clamp where hidden


def tail_masks(valid: torch.Tensor, dtype: torch.dtype) -> Tail:
    """``Tail`` of the bool (..., W) ``valid`` for blocks of ``dtype`` (float32 or float64)."""
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    return Tail(valid, valid.sum(-1).to(dtype), zero.masked_fill(~valid, -1e30),
                zero.masked_fill(~valid, _CLAMP[dtype]))


def _low(dtype: torch.dtype) -> float:
    """A finite stand-in for masked logits: exp(low - m) is 0 and 0 * low is 0 (no NaN)."""
    return torch.finfo(dtype).min / 4


#: lower clamp of z - max before exp (e^-69 ~ 1e-30; e^-690 ~ 1e-300 for float64)
_CLAMP = {torch.float32: -69.0, torch.float64: -690.0}


def top2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and second largest of each row of x (..., N), N >= 2, as ``topk(2)`` gives them
    (a tied maximum counts twice).

    Rows of 32 or more: one elementwise max over 16 strided slices (groups j, j + G, j + 2G, ...), then
    the argmax group and the runner-up group on the 16x smaller maxima (``topk`` on the whole
    row is several times slower on CPU)."""
    n = x.shape[-1]
    if n < 32:
        m, i = x.max(-1, keepdim=True)
        return m.squeeze(-1), x.scatter(-1, i, float("-inf")).amax(-1)
    g = n // 16
    xb = x[..., : 16 * g].unflatten(-1, (16, g))  # (..., 16, G): column j of slice i is i*G + j
    gmax = xb.amax(-2)  # (..., G) group j = {j, j + G, ...}
    m, gi = gmax.max(-1, keepdim=True)  # (..., 1)
    runner = gmax.scatter(-1, gi, float("-inf")).amax(-1)  # best other group
    idx = gi.unsqueeze(-2).expand(*gi.shape[:-1], 16, 1)
    inner = xb.gather(-1, idx).squeeze(-1)  # (..., 16) the winning group
    inner_second = inner.scatter(-1, inner.argmax(-1, keepdim=True), float("-inf")).amax(-1)
    m2 = torch.maximum(runner, inner_second)
    if 16 * g < n:  # the tail: at most 15 columns
        tail = x[..., 16 * g :]
        both = torch.cat([tail, m, m2.unsqueeze(-1)], -1).topk(2, dim=-1).values
        return both[..., 0], both[..., 1]
    return m.squeeze(-1), m2


def block_sums(x: torch.Tensor, valid: torch.Tensor | None = None, *,
               work: Workspace | None = None) -> Sums:
    """Per-row ``Sums`` of x (..., N) over the options where ``valid`` (broadcastable bool) is
    True, or over all N when ``valid`` is None (no masking work at all). Computed in x's dtype
    (float32 and float64 by ``_fast_sums``), returned in float64."""
    return normalized(raw_block_sums(x, valid, work=work))


def raw_block_sums(x: torch.Tensor, valid: torch.Tensor | None = None, weigh=None, *,
                   work: Workspace | None = None,
                   tail: Tail | None = None):
    """``block_sums`` before ``normalized``: in x's dtype, and rows with no valid option (or
    one) hold placeholders. Raw sums of several blocks can be concatenated and normalised at
    once (fewer small operations per block).

    ``weigh``: a linear function of the block's e^(z - m) (valid entries; hidden ones are
    below e^-69), e.g. their product with the values (the fused attention output); then the
    result is ``(sums, weigh(e))``. ``work``: where the block-sized temporaries go
    (``workspace``); x itself is never written, but with ``tail`` (instead of ``valid``;
    float32 or float64, N >= 2, no ``weigh``): which of the last W options each row sees,
    every row seeing the others (``tail_masks``). Then x must be scratch: its hidden entries
    are overwritten (``_fast_sums``)."""
    rows = x.shape[:-1]
    n_cols = x.shape[-1]
    if tail is not None:
        return _fast_sums(x, None, None, work, tail)
    if n_cols == 0:  # broadcast zeros: they keep concatenated counts small (``attention``)
        zero = torch.zeros((), dtype=x.dtype, device=x.device).expand(rows)
        return Sums(zero, zero, zero, zero, zero, zero, zero)
    if n_cols >= 2 and x.dtype in _CLAMP:
        return _fast_sums(x, valid, weigh, work)
    x, n, shape = _hidden_low(x, valid, work)
    if n_cols >= 2:
        m, m2 = top2(x)
    else:
        m = x[..., 0].clone()  # no view: the sums must not keep the block alive
        m2 = m
    d = torch.sub(x, m.unsqueeze(-1), out=take(work, "block_d", shape, x))  # (..., N) <= 0
    # exp(d) for d below ~-87 (float32) takes a slow path on CPU (denormal or zero results,
    # tens of times slower): clamp where e^d is below 1e-30 of the row's largest term. The
    # clamped terms (hidden keys included) add at most N e^-69 to s: nothing at float32 or
    # float64 precision.
    c = take(work, "block_w", shape, x)
    c = torch.clamp(d, min=_CLAMP[x.dtype], out=c) if x.dtype in _CLAMP else c.copy_(d)
    e = torch.exp(c, out=take(work, "block_e", shape, x))
    s = e.sum(-1)
    weighed = None if weigh is None else weigh(e)
    a = e.mul_(c).sum(-1)
    if valid is not None:
        d.mul_(valid.to(d.dtype))  # hidden d is finite (see _hidden_low): 0 there (cheaper than a fill)
    d1 = d.sum(-1)
    d2 = torch.mul(d, d, out=c).sum(-1)
    sums = Sums(n, m, m2, s, a, d1, d2)
    return sums if weigh is None else (sums, weighed)


def _hidden_low(x: torch.Tensor, valid: torch.Tensor | None, work: Workspace | None):
    """(x with hidden options pushed to a very low finite logit (x + ``_low``; non-finite
    entries set to ``_low``), the option count per row, the block's shape); x itself when
    nothing is hidden. An add of a mask of valid's own (broadcast) shape and ``nan_to_num_``:
    several times cheaper on CPU than a ``where`` over the block."""
    rows = x.shape[:-1]
    if valid is None:
        return x, torch.full((), float(x.shape[-1]), dtype=x.dtype, device=x.device).expand(rows), x.shape
    shape = torch.broadcast_shapes(x.shape, valid.shape)
    low = torch.full((), _low(x.dtype), dtype=x.dtype, device=x.device)
    hide = torch.where(valid, torch.zeros((), dtype=x.dtype, device=x.device), low)  # valid's shape
    # Garbage at hidden options (NaN or inf from padding) must not leak: every non-finite
    # entry becomes low too (valid options are finite logits in any model that trains).
    lo = _low(x.dtype)
    x = torch.add(x, hide, out=take(work, "block_x", shape, x)).nan_to_num_(nan=lo, posinf=lo, neginf=lo)
    return x, valid.sum(-1).to(x.dtype).expand(rows), shape


def _fast_sums(x: torch.Tensor, valid: torch.Tensor | None, weigh, work: Workspace | None,
               tail: Tail | None = None):
    """``raw_block_sums`` of a float32 or float64 block, N >= 2, in few passes: reductions
    that write nothing, and elementwise ops into block-sized tensors of ``work``.

    * Hidden options (``valid`` False) are first set to a very low finite logit.
    * m = max; d = z - m is exactly +0 at every maximum and negative elsewhere, so 1 / d is
      +inf at the maxima and negative elsewhere: 1 / min(1 / d) is the runner-up's d, and
      min(max(1 / d, 0), 1) is 1 at the maxima and 0 elsewhere, so its sum counts them (a tie
      makes m the second max, as ``topk`` does).
    * The exponentials come from ``softmax`` of c = max(d, clamp) (one fused pass): p is
      e^c / s, so s = 1 / max p (where c = 0) and a = sum e^c c = s sum p c.
    * d1 and d2 sum d and d^2 over the valid options only (d2 as a squared norm: one pass).
    * ``tail`` (the last W options, the rest all visible): the masking touches those W columns
      only, in place: hidden logits become about -1e30 (no max, no runner-up), their d is
      zeroed for d1 and d2, then their c set to the clamp (an exp like any far option's)."""
    x, n, shape = _hidden_low(x, valid, work)
    head = x.shape[-1] - (0 if tail is None else tail.valid.shape[-1])
    if tail is not None:
        x[..., head:].add_(tail.hide)  # an add: several times cheaper than a fill on a strided view
        n = tail.seen + head  # (broadcast rows)
    m = x.amax(-1)
    d = torch.sub(x, m.unsqueeze(-1), out=take(work, "block_d", shape, x))  # (..., N) <= 0
    w = torch.reciprocal(d, out=take(work, "block_w", shape, x))  # +inf at the maxima, < 0 else
    runner = w.amin(-1).reciprocal_()  # the largest d < 0 (its 1/d is the most negative)
    ties = w.clamp_(min=0.0, max=1.0).sum(-1)  # 1 at each maximum
    m2 = torch.where(ties > 1, m, m + runner)  # all maxima: runner 1/inf = 0, m2 = m as well
    if valid is None:
        if tail is not None:
            d[..., head:].mul_(tail.valid)  # hidden: 0
        d1 = d.sum(-1)
        d2 = torch.linalg.vector_norm(d, dim=-1).square_()  # one pass, no d * d block
        c = d.clamp_(min=_CLAMP[x.dtype])  # see raw_block_sums: no slow exp of tiny terms
        if tail is not None:  # hidden: 0 + the clamp
            c[..., head:].add_(tail.to_clamp)
        p = torch.ops.aten._softmax.out(c, -1, False, out=w)  # (..., N) e^c / s
    else:  # d is needed once more, with the hidden options at 0
        c = torch.clamp(d, min=_CLAMP[x.dtype], out=w)
        p = torch.ops.aten._softmax.out(c, -1, False, out=take(work, "block_e", shape, x))
    s = p.amax(-1).reciprocal()
    # a = s sum p c; e^c = s p itself only for weigh (the same a either way: equal statistics)
    weighed = None
    if weigh is None:
        a = p.mul_(c).sum(-1).mul_(s)
    else:
        a = torch.mul(p, c, out=take(work, "block_pc", shape, x)).sum(-1).mul_(s)
        weighed = weigh(p.mul_(s.unsqueeze(-1)))
    if valid is not None:
        d.mul_(valid.to(d.dtype))  # hidden d is finite (see _hidden_low): 0 there (cheaper than a fill)
        d1 = d.sum(-1)
        d2 = torch.linalg.vector_norm(d, dim=-1).square_()
    sums = Sums(n, m, m2, s, a, d1, d2)
    return sums if weigh is None else (sums, weighed)


def host_shortcuts(device: torch.device) -> bool:
    """Whether a value may be read on the host to skip work: on CPU a read is free, on a GPU it
    stalls the host until the device catches up (the GPU path never reads)."""
    return device.type == "cpu"


def _softmax_stats(p: Sums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy, max_prob, log-sum-exp) of the softmax over a part's options."""
    s = p.s.clamp(min=1e-300)
    log_s = s.log()
    return log_s - p.a / s, 1.0 / s, p.m + log_s


def _logit_stats(k: Sums) -> tuple[torch.Tensor, torch.Tensor]:
    """(population std, max - mean) of a part's logits."""
    nf = k.n.clamp(min=1)
    mean_d = k.d1 / nf  # mean - max
    var = (k.d2 / nf - mean_d * mean_d).clamp(min=0)
    return var.sqrt(), -mean_d


def _peaked_entropy(entropy: torch.Tensor, n: Counts) -> tuple[torch.Tensor, torch.Tensor]:
    b = beta_eff(entropy, n)
    return b, (b > n.threshold).to(torch.float64)


def finish(
    keys: Sums,
    ok: torch.Tensor,
    *,
    first: torch.Tensor | None = None,
    rest: Sums | None = None,
    sink: torch.Tensor | None = None,
    target_logit: torch.Tensor | None = None,
    n_max: int | None = None,
) -> RowStats:
    """Every statistic per row, float64, from the ``Sums`` of the row's keys (or vocabulary).

    Args:
        keys: sums over every visible option of the row (its logits).
        ok: bool (row shape): rows to keep; rows with no option are dropped as well.
        first: logit of the row's first visible key: adds ``first_key_prob``.
        rest: sums over the visible keys but the first: adds the ``_xsink`` statistics (rows
            with fewer than two such keys are skipped for them).
        sink: a learned sink logit per row (gpt-oss): one more option of the softmax. It enters
            the probabilities (entropy, entropy_norm and beta_eff over n + 1 options,
            max_prob, first_key_prob) and adds ``sink_prob``; the logit statistics (logit_std,
            logit_max_minus_mean, logit_top_gap, peaked) stay over the n real keys.
        target_logit: the next token's logit (LM head; NaN where there is none): adds
            ``loss``, ``target_prob``, ``target_logit_minus_mean``.
        n_max: a bound on every row's option count (``keys.n``), when the caller knows one:
            the count's logs and thresholds then come from per-n tables (``counts``).
    """
    f64 = torch.float64
    ok = ok & (keys.n > 0)
    okf = ok.to(f64)
    soft = keys if sink is None else merge_one(keys, sink.to(f64).expand_as(keys.m))
    key_n = counts(keys.n, n_max)
    opt_n = key_n if sink is None else counts(soft.n, None if n_max is None else n_max + 1)
    entropy, max_prob, lse = _softmax_stats(soft)
    std, max_minus_mean = _logit_stats(keys)
    two_keys = (ok & (keys.n > 1)).to(f64)
    two_opt = two_keys if sink is None else (ok & (soft.n > 1)).to(f64)
    b_eff, p_ent = _peaked_entropy(entropy, opt_n)
    values = {vocab.ENTROPY: entropy, vocab.ENTROPY_NORM: entropy / opt_n.log_n, vocab.MAX_PROB: max_prob,
              vocab.LOGIT_STD: std, vocab.LOGIT_MAX_MINUS_MEAN: max_minus_mean,
              vocab.LOGIT_TOP_GAP: keys.m - keys.m2, vocab.PEAKED: (std > key_n.threshold).to(f64)}
    weight = {name: okf for name in values}
    weight[vocab.ENTROPY_NORM] = two_opt
    weight[vocab.LOGIT_TOP_GAP] = two_keys
    if first is not None:
        values[vocab.FIRST_KEY_PROB] = (first.to(f64) - lse).exp()
        weight[vocab.FIRST_KEY_PROB] = okf
    if target_logit is not None:
        _add_target(values, weight, target_logit.to(f64), ok, lse, keys.m - max_minus_mean)
    # the real options' max in LOGIT_ROW_MAX (a learned sink is not one)
    values.update({vocab.BETA_EFF: b_eff, vocab.PEAKED_ENTROPY: p_ent, vocab.LOGIT_ROW_MAX: keys.m})
    weight.update({vocab.BETA_EFF: two_opt, vocab.PEAKED_ENTROPY: two_opt, vocab.LOGIT_ROW_MAX: okf})
    if rest is not None:
        _add_xsink(values, weight, rest, ok, n_max)
    if sink is not None:
        values[vocab.SINK_PROB] = (sink.to(f64).expand_as(lse) - lse).exp()
        weight[vocab.SINK_PROB] = okf
    _zero_undefined(values, weight)
    return RowStats(values=values, weight=weight)


def _add_target(values: dict, weight: dict, zt: torch.Tensor, ok: torch.Tensor, lse: torch.Tensor,
                mean: torch.Tensor) -> None:
    """The LM head's ``vocab.LM_EXTRA`` from the target logit ``zt`` (NaN where none)."""
    tgt = (ok & ~torch.isnan(zt)).to(torch.float64)
    loss = lse - zt
    values[vocab.LOSS] = loss
    values[vocab.TARGET_PROB] = (-loss).exp()
    values[vocab.TARGET_LOGIT_MINUS_MEAN] = zt - mean
    for name in vocab.LM_EXTRA:
        weight[name] = tgt


def _add_xsink(values: dict, weight: dict, rest: Sums, ok: torch.Tensor, n_max: int | None) -> None:
    """The ``_xsink`` statistics from the sums over the keys but the first (rows with fewer than
    two such keys skipped)."""
    rest_n = counts(rest.n, n_max)
    x_ent, x_max, _ = _softmax_stats(rest)
    x_std, _ = _logit_stats(rest)
    x_b, x_pe = _peaked_entropy(x_ent, rest_n)
    x_vals = (x_ent, x_max, x_std, (x_std > rest_n.threshold).to(torch.float64), x_b, x_pe)
    x_ok = (ok & (rest.n > 1)).to(torch.float64)
    for name, v in zip(vocab.XSINK_METRICS, x_vals, strict=True):
        values[name] = v
        weight[name] = x_ok


def _zero_undefined(values: dict, weight: dict) -> None:
    """Zero the entries of rows a metric's weight drops, so that NaN/inf never leak into sums
    (on CPU not where a weight keeps every row: the check is cheaper than the where)."""
    keep: dict[int, torch.Tensor | None] = {}  # one bool mask per distinct weight tensor
    for name, v in values.items():
        w = weight[name]
        if id(w) not in keep:
            k = w > 0
            keep[id(w)] = None if host_shortcuts(k.device) and bool(k.all()) else k
        if keep[id(w)] is not None:
            values[name] = torch.where(keep[id(w)], v, torch.zeros((), dtype=v.dtype, device=v.device))


def target_logit(z: torch.Tensor, valid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """float64 logit of each row's target option (``row_stats``' target), NaN where none."""
    t = target.clamp(min=0).unsqueeze(-1)
    zt = z.gather(-1, t).squeeze(-1).to(torch.float64)
    tv = valid.expand_as(z).gather(-1, t).squeeze(-1)
    return torch.where((target >= 0) & tv, zt, torch.full_like(zt, float("nan")))


def row_stats(
    z: torch.Tensor,
    valid: torch.Tensor,
    row_valid: torch.Tensor | None = None,
    *,
    first_key: bool = False,
    target: torch.Tensor | None = None,
    work: Workspace | None = None,
) -> RowStats:
    """Statistics of each row of ``z`` over the options where ``valid`` is True.

    Args:
        z: logits, shape ``(*R, N)`` (N options per row), already scaled/softcapped as the
            model does; the block passes run in ``z.dtype``, the per-row results in float64.
        valid: bool, broadcastable to ``z``: which options the row may use (masks applied).
        row_valid: bool, broadcastable to ``R``: rows to keep (e.g. not a padding query).
            Rows with no valid option are always dropped.
        first_key: also report ``first_key_prob`` and the ``_xsink`` statistics (the row's
            first valid option left out; the first real token in a left-padded batch).
        target: int64 of shape ``R``: index of the next token (-1: none), to report ``loss``,
            ``target_prob`` and ``target_logit_minus_mean`` (LM head).
        work: where the block-sized temporaries go (``workspace``; fresh tensors if None).
    """
    rows = z.shape[:-1]
    all_valid = bool(valid.all())
    ok = torch.ones(rows, dtype=torch.bool, device=z.device)
    if row_valid is not None:
        ok = ok & row_valid.expand(rows)
    zt = None if target is None else target_logit(z, valid, target)
    if not first_key:
        keys = block_sums(z, None if all_valid else valid, work=work)
        return finish(keys, ok, target_logit=zt, n_max=z.shape[-1])
    v = valid.expand_as(z)
    idx = v.to(torch.int8).argmax(-1, keepdim=True)  # first True per row
    present = v.gather(-1, idx).squeeze(-1)
    zf = z.gather(-1, idx).squeeze(-1)
    rest = block_sums(z, v.scatter(-1, idx, False), work=work)
    keys = merge_one(rest, zf, present)
    return finish(keys, ok, first=zf, rest=rest, target_logit=zt, n_max=z.shape[-1])
