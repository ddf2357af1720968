"""The Triton kernel source of the per-site attention statistics (``triton_kernel`` launches it).

One program per (batch, head, block of BLOCK_M query rows). Row r sees the keys
[start_r, end_r); its first visible key start_r is kept apart (its logit ``f`` comes from one
dot product per row before the key loop), so the loop reduces the keys (start_r, end_r) only.
Per key tile (BLOCK_N keys: one TMA copy of the key tile, one ``tl.dot`` with float32
accumulation) every running value is kept per row and lane: the keys 8 i + 2 l + e of lane
l = 0..3, which on a tensor-core accumulator one thread holds, so a tile folds its logits z in
with no shuffle between threads (``_lanes``). Each lane keeps:

* its two largest logits (l1, l2; a tied maximum counts twice, as ``topk``): one tree
  reduction of (max, second) pairs (``_top_two``) per tile, merged into the running pair;
* ``se = sum 2^x`` and ``sx = sum 2^x x`` with x = z c - mc, c = scaling log2(e) and
  mc = l1 c rounded once per tile (one FMA per logit). A new max moves the sums by the
  difference of the two rounded products (exact when they are within a factor two), so the
  sums keep their accuracy when |z| >> the spread;
* ``q1 = sum x`` and ``q2 = sum x^2``, relative to the running max like the softmax sums (a
  new max moves them: q2 += 2 shift q1 + n shift^2, q1 += n shift): the logit mean and std
  without a per-tile mean or variance merge.

The sums of products (sx, q2) run as one chain of FMAs over each lane's keys (``_chain``): one
instruction a key, as the plain sums' trees take. After the sweep the four lanes are merged (their sums
moved to the row's max) and the two largest logits taken relative to ``f`` (d = z - f, once
per row): the epilogue merges the first key at d = 0.

Programs of the heads that share a key head are adjacent in the grid (their key tiles meet in
L2), and the query blocks with the longest key ranges start first.

Tiles inside every kept row's range take the unmasked path; the block's boundary tiles are
masked by index; tiles before the smallest start + 1 or from the largest end on are never
visited. The epilogue merges ``f`` and a learned sink logit into the sums as ``sums.merge_one``
does, derives every statistic of ``rows.finish`` per row in float32 (``beta_eff`` by the
branch-free bracketed search of ``gaussian_entropy._beta_eff_tabled``, on float32 copies of its
per-n tables), and writes per program the sums and counts of its kept rows, their largest
logit, and adds their histogram bins of entropy and max_prob to a per-head int32 histogram
(atomic adds: integer, so exact and order-free).

Column order of the per-program record (``triton_kernel`` checks it against ``rows``): the
``VALUES`` sums, then their counts, then the largest logit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import vocab

#: the per-row statistics the kernel writes, in this order (= ``rows.attn_metric_names(True)``)
VALUES: tuple[str, ...] = (
    vocab.ENTROPY, vocab.ENTROPY_NORM, vocab.MAX_PROB, vocab.LOGIT_STD, vocab.LOGIT_MAX_MINUS_MEAN,
    vocab.LOGIT_TOP_GAP, vocab.PEAKED, vocab.FIRST_KEY_PROB, vocab.BETA_EFF, vocab.PEAKED_ENTROPY,
    *vocab.XSINK_METRICS, vocab.LOGIT_ROW_MAX, vocab.SINK_PROB,
)  # fmt: skip
N_VALUES = len(VALUES)
N_VALUES_C: tl.constexpr = tl.constexpr(N_VALUES)
#: per program: N_VALUES sums, N_VALUES counts, the largest logit
RECORD = 2 * N_VALUES + 1
MAX_COL = 2 * N_VALUES

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """tanh from exp (core triton has none): odd, a Taylor series near 0 (no cancellation)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    th = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    th = tl.where(ax < 0.2, series, th)
    return tl.where(x < 0, -th, th)


@triton.jit
def _beta_eff(entropy, n, curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr, size, stride, nb,
              CELLS: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
    """``gaussian_entropy._beta_eff_tabled`` per row (float32): the bracket of the row's
    (n, cell of h), a branch-free search of STEPS steps (an overshoot lands on a -inf pad or a
    lower curve value), then the root of the linear piece. Rows with n < 2 give garbage that
    their weight drops; every index stays inside the tables."""
    log_n = tl.log(tl.maximum(n, 2.0))
    h = entropy / log_n
    k = tl.minimum(tl.maximum(n, 0.0), size * 1.0).to(tl.int32)
    hc = tl.where(h == h, h * CELLS, 0.0)  # NaN -> cell 0, as nan_to_num
    cell = tl.minimum(tl.maximum(hc, 0.0), CELLS - 1.0).to(tl.int32)
    row = k * stride
    pos = tl.load(lo_ptr + tl.load(cell_base_ptr + k) + cell) + row
    for i in tl.static_range(STEPS):
        cand = pos + (1 << (STEPS - 1 - i))
        pos = tl.where(tl.load(curves_ptr + cand) >= h, cand, pos)
    j = tl.minimum(pos - row, nb - 2)
    c0 = tl.load(curves_ptr + row + j)
    c1 = tl.load(curves_ptr + row + j + 1)
    frac = tl.minimum(tl.maximum((c0 - h) / tl.maximum(c0 - c1, 1e-30), 0.0), 1.0)
    b0 = tl.load(bgrid_ptr + j)
    b1 = tl.load(bgrid_ptr + j + 1)
    b = tl.where(h >= 1.0, 0.0, b0 + (b1 - b0) * frac)
    return b * tl.sqrt(2.0 * log_n)


@triton.jit
def _scores(q, k_desc, kb, kh, n0, scaling, softcap,
            SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """(M, N) float32 logits of the keys n0 .. n0 + N (softcapped, or raw q.k). The key tile
    comes by one tensor-memory copy (TMA on Hopper): keys past the end and head dims past D
    read as zeros, so no tile needs an index mask to load."""
    kt = tl.reshape(k_desc.load([kb, kh, n0, 0]), (BLOCK_N, BLOCK_D))  # (N, Dp)
    if DOT_FP32:
        kt = kt.to(tl.float32)
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION)  # (M, N) float32
    if SOFTCAP:
        s = softcap * _tanh(s * (scaling / softcap))
    return s


@triton.jit
def _top_two(a1, a2, b1, b2):
    """The top two of two top twos (a tie counts twice, as ``topk``)."""
    # NaN-propagating: max(x, -inf) = x then holds for every x, so the -inf seeds fold away
    hi = tl.maximum(a1, b1, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(a1, b1, propagate_nan=tl.PropagateNan.ALL)
    sec = tl.maximum(a2, b2, propagate_nan=tl.PropagateNan.ALL)
    return hi, tl.maximum(sec, lo, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tile(q, k_desc, kb, kh, n0, st, en, l1, l2, mc, se, sx, n, q1, q2, scaling, softcap, c,
          MASKED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
          DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Fold keys n0 .. n0 + BLOCK_N into each row's online sums. MASKED: only keys in
    (st, en) count (the first visible key st is kept apart); else every key of the tile is
    visible to every kept row (rows not kept accumulate what they like: their weight is 0).

    Every running value is (M, 4): per row, the keys 8 i + 2 l + e of each lane l apart
    (``_lanes``), which on a tensor-core accumulator are one thread's, so a tile folds them
    in with no shuffle between threads: each lane's top two (l1, l2) and its online sums
    (se, sx, n, q1, q2), relative to its own max l1. ``_sweep_keys`` merges the four lanes."""
    z = _scores(q, k_desc, kb, kh, n0, scaling, softcap,
                SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D)  # (M, N)
    if MASKED:  # hidden keys -inf (no mask is kept: -inf marks them below)
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (N,)
        v = (offs_n[None, :] > st[:, None]) & (offs_n[None, :] < en[:, None])
        z = tl.where(v, z, float("-inf"))
    z = tl.reshape(z, (z.shape[0], BLOCK_N // 8, 4, 2))  # (M, N/8, 4, 2)
    # each lane's top two in the tile, then of all its keys so far (l1, l2)
    a1, a2 = tl.reduce((z, tl.full(z.shape, float("-inf"), tl.float32)), 1, _top_two)
    a1, a2 = tl.reduce((a1, a2), 2, _top_two)  # (M, 4)
    l2 = tl.maximum(l2, tl.maximum(a2, tl.minimum(l1, a1)))
    l1 = tl.maximum(l1, a1)
    # the sums are relative to mc = l1 c as rounded once: a new max moves them by the
    # difference of the two rounded products (exact when close: Sterbenz), so |z| >> spread
    # costs no accuracy. A lane with no key yet has mc = -1e30: its first keys' shift then
    # gives alpha = 0 (its sums are 0), finite where 0 - (-inf) would not be
    mc_new = l1 * c  # (M, 4)
    if MASKED:
        mc_new = tl.where(l1 == float("-inf"), -1e30, mc_new)
    shift = mc - mc_new  # (M, 4) <= 0
    alpha = tl.exp2(shift)
    x = z * c - mc_new[:, :, None][:, None, :, :]  # (M, N/8, 4, 2) log2 units, <= 0: one FMA
    if MASKED:
        x = tl.maximum(x, -1e30)  # hidden (-inf): p = 0 and p x = 0
        xz = tl.where(x > -1e30, x, 0.0)  # and no part in q1, q2
        nb = _lanes(tl.where(x > -1e30, 1.0, 0.0))
    else:
        xz = x
        nb = BLOCK_N / 4.0
    p = tl.exp2(x)
    sx = _chain(_by_lane(p), _by_lane(x), alpha * (sx + shift * se), BLOCK_N // 4)
    se = alpha * se + _lanes(p)
    # sum x and sum x^2 straight, relative to the running max: moved to a new max per lane
    q1_moved = q1 + n * shift  # the old sums, moved to the new max
    q2 = q2 + shift * (q1 + q1_moved)  # = sum (x + shift)^2
    q1 = q1_moved + _lanes(xz)
    xl = _by_lane(xz)
    q2 = _chain(xl, xl, q2, BLOCK_N // 4)
    return l1, l2, mc_new, se, sx, n + nb, q1, q2


@triton.jit
def _by_lane(t):
    """(M, N/8, 4, 2) -> (M, 4, N/4): each lane's keys in the last axis."""
    t = tl.permute(t, (0, 2, 1, 3))  # (M, 4, N/8, 2)
    return tl.reshape(t, (t.shape[0], 4, t.shape[2] * 2))


@triton.jit
def _chain(a, b, acc, R: tl.constexpr):
    """acc + sum over the last axis (R keys) of a b, (M, 4, R) -> (M, 4), as one chain of
    FMAs: the halves are split apart (in registers, free) down to single keys. Triton's own
    sum is a tree, which costs a multiply and an add per pair where a chain costs one FMA."""
    if R == 1:
        return acc + tl.reshape(a, (a.shape[0], 4)) * tl.reshape(b, (b.shape[0], 4))
    else:
        a0, a1 = tl.split(tl.reshape(a, (a.shape[0], 4, R // 2, 2)))
        b0, b1 = tl.split(tl.reshape(b, (b.shape[0], 4, R // 2, 2)))
        return _chain(a1, b1, _chain(a0, b0, acc, R // 2), R // 2)


@triton.jit
def _lanes(t):
    """(M, N/8, 4, 2) -> (M, 4): sums over i and e of the keys 8 i + 2 l + e."""
    return tl.sum(tl.sum(t, 1), 2)


@triton.jit
def _rows(start_ptr, end_ptr, rowv_ptr, b, offs_m, Tq, Tk, ssb, sst, seb, set_, srb, srt):
    """The block's rows: in range (M,), first visible key st, end en (clamped to 0..Tk), and
    kept: counted rows (valid, with a key)."""
    in_q = offs_m < Tq
    st = tl.maximum(tl.load(start_ptr + b * ssb + offs_m * sst, mask=in_q, other=0), 0)
    en = tl.minimum(tl.load(end_ptr + b * seb + offs_m * set_, mask=in_q, other=0), Tk)
    rv = tl.load(rowv_ptr + b * srb + offs_m * srt, mask=in_q, other=0)
    return in_q, st, en, in_q & (rv != 0) & (en > st)


@triton.jit
def _first_logit(q, k_base, st, kept, offs_d, dmask, skt, skd, scaling, softcap,
                 SOFTCAP: tl.constexpr):  # fmt: skip
    """(M,) the logit of each row's first visible key: one dot product per row (softcapped, or
    raw q.k: the caller's ``unit`` scales it)."""
    first = tl.where(kept, st, 0)
    kf = tl.load(k_base + first[:, None] * skt + offs_d[None, :] * skd,
                 mask=kept[:, None] & dmask[None, :], other=0.0)  # (M, Dp)
    f = tl.sum(q.to(tl.float32) * kf.to(tl.float32), 1)  # (M,)
    if SOFTCAP:
        f = softcap * _tanh(f * (scaling / softcap))
    return f


@triton.jit
def _key_tiles(kept, st, en, BLOCK_N: tl.constexpr):
    """The block's key tiles: [lo_t, fs) masked, [fs, fe) every kept row sees every key,
    [fe, hi) masked."""
    big = 1 << 30
    lo = tl.min(tl.where(kept, st + 1, big), 0)
    hi = tl.max(tl.where(kept, en, 0), 0)
    full_lo = tl.max(tl.where(kept, st + 1, 0), 0)
    full_hi = tl.min(tl.where(kept, en, big), 0)
    lo_t = (lo // BLOCK_N) * BLOCK_N
    hi_t = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    fs = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo_t), hi_t)
    fe = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, fs), hi_t)
    return lo_t, fs, fe, hi


@triton.jit
def _sweep_keys(q, k_desc, kb, kh, st, en, f, kept, scaling, softcap, c,
                SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Every key tile folded into the rows' online sums (``_tile``), then the four lanes
    merged: (m, the second largest m2, se, sx, n, q1, q2); m and m2 relative to ``f``, the
    sums to m c as rounded."""
    lo_t, fs, fe, hi = _key_tiles(kept, st, en, BLOCK_N)
    neg_inf = float("-inf")
    # per row and lane (``_tile``): over the other keys
    l1 = tl.full((BLOCK_M, 4), neg_inf, tl.float32)  # the largest z
    l2 = tl.full((BLOCK_M, 4), neg_inf, tl.float32)  # the second largest (a tie counts twice)
    mc = tl.full((BLOCK_M, 4), -1e30, tl.float32)  # l1 c, rounded: what x is relative to
    se = tl.zeros((BLOCK_M, 4), tl.float32)  # sum 2^x, x = z c - mc
    sx = tl.zeros((BLOCK_M, 4), tl.float32)  # sum 2^x x
    n = tl.zeros((BLOCK_M, 4), tl.float32)  # other keys
    q1 = tl.zeros((BLOCK_M, 4), tl.float32)  # their sum of x
    q2 = tl.zeros((BLOCK_M, 4), tl.float32)  # their sum of x^2
    for n0 in range(lo_t, fs, BLOCK_N):
        l1, l2, mc, se, sx, n, q1, q2 = _tile(
            q, k_desc, kb, kh, n0, st, en, l1, l2, mc, se, sx, n, q1, q2, scaling, softcap, c,
            True, SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    for n0 in range(fs, fe, BLOCK_N):
        l1, l2, mc, se, sx, n, q1, q2 = _tile(
            q, k_desc, kb, kh, n0, st, en, l1, l2, mc, se, sx, n, q1, q2, scaling, softcap, c,
            False, SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    for n0 in range(fe, hi, BLOCK_N):
        l1, l2, mc, se, sx, n, q1, q2 = _tile(
            q, k_desc, kb, kh, n0, st, en, l1, l2, mc, se, sx, n, q1, q2, scaling, softcap, c,
            True, SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    # the lanes merged: their sums moved to the row's max, as a new max moves them in _tile
    m, r = tl.reduce((l1, l2), 1, _top_two)  # (M,) the largest and second largest
    mc_row = tl.where(m == neg_inf, -1e30, m * c)
    d = mc - mc_row[:, None]  # (M, 4) <= 0
    a = tl.exp2(d)
    se_r = tl.sum(a * se, 1)
    sx_r = tl.sum(a * (sx + d * se), 1)
    q2_r = tl.sum(q2 + d * (n * d + 2.0 * q1), 1)
    q1_r = tl.sum(q1 + n * d, 1)
    return m - f, r - f, se_r, sx_r, tl.sum(n, 1), q1_r, q2_r  # maxima relative to f


@triton.jit
def _row_values(m, m2, se, sx, n, q1, q2, f, unit, c, sig, has_sink,
                curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr, tab_size, tab_stride, tab_nb,
                CELLS: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
    """The epilogue, per row, in natural units relative to f: every statistic of ``VALUES``
    in order, then the rows' option, key and other-key counts, entropy and max_prob."""
    nr = n
    has_r = nr > 0.0
    mr = m * unit  # -inf without other keys
    lr = tl.where(has_r, se, 0.0)
    ar = tl.where(has_r, sx * LN2, 0.0)  # sum e^(z - max) (z - max)
    n1 = tl.maximum(nr, 1.0)
    mur = tl.where(has_r, (m + q1 / (n1 * c)) * unit, 0.0)  # mean z - f of the other keys
    M2r = tl.maximum(q2 - q1 * q1 / n1, 0.0) * (LN2 * LN2)  # their centred sum of squares (z^2)
    # the other keys alone (_xsink)
    lr1 = tl.where(has_r, lr, 1.0)
    ent_x = tl.log(lr1) - ar / lr1
    std_x = tl.sqrt(tl.maximum(M2r / tl.maximum(nr, 1.0), 0.0))
    thr_x = tl.sqrt(2.0 * tl.log(tl.maximum(nr, 1.0)))
    beta_x = _beta_eff(ent_x, nr, curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr,
                       tab_size, tab_stride, tab_nb, CELLS, STEPS)  # fmt: skip
    # merged with the first key (d = 0), as sums.merge_one
    mk = tl.maximum(mr, 0.0)
    dx = tl.where(has_r, mr - mk, 0.0)
    ex = tl.exp(dx)
    ey = tl.exp(-mk)
    lk = lr * ex + ey
    ak = ex * (ar + dx * lr) - ey * mk
    nk = nr + 1.0
    m2k = tl.maximum(tl.minimum(mr, 0.0), m2 * unit)
    muk = mur * (nr / nk)
    M2k = M2r + mur * mur * (nr / nk)
    # with a learned sink: one more option of the softmax (not of the logit statistics)
    srel = sig.to(tl.float32) - f * unit
    ms = tl.maximum(mk, srel)
    e1 = tl.exp(mk - ms)
    e2 = tl.exp(srel - ms)  # 0 without a sink
    ls = lk * e1 + e2
    as_ = e1 * (ak + (mk - ms) * lk) + e2 * tl.where(e2 > 0.0, srel - ms, 0.0)
    entropy = tl.log(ls) - as_ / ls
    lse = ms + tl.log(ls)
    n_opt = nk + has_sink
    std = tl.sqrt(tl.maximum(M2k / nk, 0.0))
    thr = tl.sqrt(2.0 * tl.log(nk))
    beta = _beta_eff(entropy, n_opt, curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr,
                     tab_size, tab_stride, tab_nb, CELLS, STEPS)  # fmt: skip
    max_prob = 1.0 / ls
    row_max = (tl.maximum(m, 0.0) + f) * unit  # the largest real logit (d = 0: the first key)
    thr_opt = tl.sqrt(2.0 * tl.log(tl.maximum(n_opt, 1.0)))
    values = (
        entropy, entropy / tl.log(tl.maximum(n_opt, 2.0)), max_prob, std, mk - muk, mk - m2k,
        tl.where(std > thr, 1.0, 0.0), tl.exp(-lse), beta, tl.where(beta > thr_opt, 1.0, 0.0),
        ent_x, 1.0 / lr1, std_x, tl.where(std_x > thr_x, 1.0, 0.0), beta_x,
        tl.where(beta_x > thr_x, 1.0, 0.0), row_max, tl.exp(srel - lse),
    )  # fmt: skip
    return values, n_opt, nk, nr


@triton.jit
def _store_record(base, values, kept, n_opt, nk, nr, has_sink):
    """One program's record: each statistic's sum over its rows, their count, the largest
    logit (``VALUES[16]``, the row max, over the kept rows)."""
    two_opt = kept & (n_opt >= 2.0)
    two_keys = kept & (nk >= 2.0)
    x_ok = kept & (nr >= 2.0)
    with_sink = kept & (has_sink > 0)
    # each statistic's rows: kept (0), two options (1), two keys (2), two other keys (3), sink (4)
    weights = (kept, two_opt, two_keys, x_ok, with_sink)
    CLASS: tl.constexpr = (0, 1, 0, 0, 0, 2, 0, 0, 1, 1, 3, 3, 3, 3, 3, 3, 0, 4)
    counts = (
        tl.sum(kept.to(tl.float32), 0), tl.sum(two_opt.to(tl.float32), 0),
        tl.sum(two_keys.to(tl.float32), 0), tl.sum(x_ok.to(tl.float32), 0),
        tl.sum(with_sink.to(tl.float32), 0),
    )  # fmt: skip
    for j in tl.static_range(N_VALUES_C):
        tl.store(base + j, tl.sum(tl.where(weights[CLASS[j]], values[j], 0.0), 0))
        tl.store(base + N_VALUES_C + j, counts[CLASS[j]])
    tl.store(base + 2 * N_VALUES_C, tl.max(tl.where(kept, values[16], float("-inf")), 0))


@triton.jit
def _histograms(hist_base, entropy, max_prob, kept, lo0, scale0, lo1, scale1, BINS: tl.constexpr):
    """The kept rows' bins of entropy and max_prob, added to the head's int32 counts (atomic
    adds: integer, so exact and order-free)."""
    bins = tl.arange(0, BINS)
    be = tl.where(kept, (entropy - lo0) * scale0, 0.0)
    be = tl.minimum(tl.maximum(be, 0.0), BINS - 1.0).to(tl.int32)
    he = tl.histogram(be, BINS, mask=kept)
    tl.atomic_add(hist_base + bins, he, mask=he > 0, sem="relaxed")
    bp = tl.where(kept, (max_prob - lo1) * scale1, 0.0)
    bp = tl.minimum(tl.maximum(bp, 0.0), BINS - 1.0).to(tl.int32)
    hp = tl.histogram(bp, BINS, mask=kept)
    tl.atomic_add(hist_base + BINS + bins, hp, mask=hp > 0, sem="relaxed")


@triton.jit
def site_kernel(
    q_ptr, k_ptr, k_desc, start_ptr, end_ptr, rowv_ptr, sink_ptr, out_ptr, hist_ptr,
    curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr,
    H, G, Tq, Tk, D,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    ssb, sst, seb, set_, srb, srt,
    sib, sih, sit,
    scaling, softcap, has_sink,
    hist_lo0, hist_scale0, hist_lo1, hist_scale1,
    tab_size, tab_stride, tab_nb,
    SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no head-dim mask
    DOT_FP32: tl.constexpr,  # upcast q, k tiles before the dot (the interpreter's dot needs it)
    DOT_PRECISION: tl.constexpr,  # float32 operands: "tf32x3" or "ieee"
    CELLS: tl.constexpr,
    STEPS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) query blocks first
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,) query rows
    offs_d = tl.arange(0, BLOCK_D)  # (Dp,)
    in_q, st, en, kept = _rows(start_ptr, end_ptr, rowv_ptr, b, offs_m, Tq, Tk, ssb, sst, seb, set_, srb, srt)
    dmask = offs_d < (BLOCK_D if EVEN_D else D)
    q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=in_q[:, None] & dmask[None, :], other=0.0)  # (M, Dp)
    k_base = k_ptr + b * skb + (h // G) * skh
    f = _first_logit(q, k_base, st, kept, offs_d, dmask, skt, skd, scaling, softcap, SOFTCAP)
    unit = 1.0 if SOFTCAP else scaling  # logits: the softcapped z, or raw q.k with z = scaling q.k
    c = unit * LOG2E  # x = d c: log2 units
    if DOT_FP32:
        q = q.to(tl.float32)
    m, m2, se, sx, n, q1, q2 = _sweep_keys(
        q, k_desc, b.to(tl.int32), (h // G).to(tl.int32), st, en, f, kept, scaling, softcap, c,
        SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    sig = tl.load(sink_ptr + b * sib + h * sih + offs_m * sit, mask=in_q, other=float("-inf"))
    values, n_opt, nk, nr = _row_values(
        m, m2, se, sx, n, q1, q2, f, unit, c, sig, has_sink,
        curves_ptr, cell_base_ptr, lo_ptr, bgrid_ptr, tab_size, tab_stride, tab_nb, CELLS, STEPS,
    )  # fmt: skip
    base = out_ptr + (pid_bh.to(tl.int64) * tl.num_programs(1) + pid_m) * (2 * N_VALUES_C + 1)
    _store_record(base, values, kept, n_opt, nk, nr, has_sink)
    _histograms(hist_ptr + h * (2 * BINS), values[0], values[2], kept,
                hist_lo0, hist_scale0, hist_lo1, hist_scale1, BINS)
