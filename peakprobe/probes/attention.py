"""Per-head attention statistics from query and key states, in query-row chunks (torch path).

This is the reference implementation the optional Triton kernel must match. It rebuilds the
attention logits exactly as a Hugging Face attention function would (scaling, optional
softcapping, an additive position bias, grouped-query heads, the additive or boolean mask, or
causal / sliding-window structure when no mask is materialised, a learned sink logit) one chunk
of query rows at a time, so nothing of size T x T per head ever exists beyond one chunk.

Each chunk's logits are reduced once to per-row ``sums.Sums``. With causal structure and no mask
tensor, key 0 (the first visible key) is kept apart for the ``_xsink`` statistics and no
masking work touches most of the block: the statistics mask only each chunk's diagonal corner,
in place (``_causal_chunk``); the fused path reduces the keys every row of the
chunk sees unmasked and the diagonal blocks of all chunks in one batch (``_diagonal``). Other
masks take one masked fill. The per-row sums of all chunks are merged and turned into
statistics once per call.

``attention_forward_with_sums`` (the opt-in fused path) also returns the attention output,
computed from the same exponentials, so QK^T is done once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .accumulate import SiteSums, reduce_rows
from .rows import attn_metric_names, finish, raw_block_sums, tail_masks
from .sums import Sums, merge, merge_one, normalized
from .workspace import Workspace, take


@dataclass(frozen=True)
class MaskSpec:
    """How the model masks attention, as the attention function received it.

    ``mask`` is None (structure given by ``causal`` / ``sliding_window``), a bool tensor
    (True = may attend) or an additive float tensor (a very negative entry = may not attend),
    of shape (B, 1 or H, Tq, Tk). ``q_offset`` is the position of query 0 among the keys.
    """

    mask: torch.Tensor | None = None
    causal: bool = True
    sliding_window: int | None = None
    q_offset: int = 0


def _chunk_logits(
    q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None,
    work: Workspace | None = None,
) -> torch.Tensor:
    """Scores of a query chunk against keys, grouped-query heads expanded.

    q: (B, H, C, D); k: (B, Hkv, Tk, D) -> (B, H, C, Tk)
    """
    b, h, c, d = q.shape
    hkv = k.shape[1]
    # The scaling (and 1 / softcap) multiply the small query chunk, not the block.
    factor = scaling if softcap is None else scaling / softcap
    qg = (q * factor).reshape(b, hkv, (h // hkv) * c, d)  # (B, Hkv, G*C, D)
    out = take(work, "logits", (b, hkv, (h // hkv) * c, k.shape[2]), qg)
    z = torch.matmul(qg, k.transpose(-1, -2), out=out).view(b, h, c, k.shape[2])  # (B, H, C, Tk)
    if softcap is not None:
        z = z.tanh_().mul_(softcap)
    return z


def _grouped_matmul(e: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """e (B, H, C, N) @ v (B, Hkv, N, Dv) -> (B, H, C, Dv), grouped-query heads shared."""
    b, h, c, n = e.shape
    hkv = v.shape[1]
    return torch.matmul(e.reshape(b, hkv, (h // hkv) * c, n), v).view(b, h, c, v.shape[-1])


def _index_valid(spec: MaskSpec, i0: int, i1: int, k0: int, k1: int, device) -> torch.Tensor:
    """(1, 1, C, k1 - k0) bool: which keys k0:k1 rows i0:i1 see, by causal / window structure."""
    qpos = torch.arange(i0, i1, device=device).unsqueeze(-1) + spec.q_offset  # (C, 1)
    kpos = torch.arange(k0, k1, device=device).unsqueeze(0)  # (1, K)
    valid = torch.ones(i1 - i0, k1 - k0, dtype=torch.bool, device=device)
    if spec.causal:
        valid = valid & (kpos <= qpos)
    if spec.sliding_window is not None:
        valid = valid & (kpos > qpos - spec.sliding_window)
    return valid.view(1, 1, i1 - i0, k1 - k0)


@dataclass
class _Chunk:
    core: Sums  # raw sums over the visible keys but the first that need no mask (B, H, C)
    edge: Sums | None  # raw sums over the masked keys but the first (B, H, C); None: no such part
    first: torch.Tensor  # logit of the first visible key (B, H, C)
    present: torch.Tensor  # the row has a visible key (B|1, 1|H, C)
    out: torch.Tensor | None = None  # fused: sum e^(z - out_m) v over the chunk's part (B, H, C, Dv)
    out_m: torch.Tensor | None = None  # (B, H, C)


def _empty(z: torch.Tensor) -> Sums:
    return raw_block_sums(z[..., :0])


def _fused_part(z, m, valid, v, dtype) -> torch.Tensor:
    """sum_j e^(z_j - m) v_j over the valid keys: z (B, H, C, N), m (B, H, C), v (B, Hkv, N, Dv)."""
    e = (z - m.unsqueeze(-1)).clamp_(max=0.0).exp_()  # clamp: rows with no valid key (m = low)
    if valid is not None:
        e = e.masked_fill_(~valid, 0.0)
    return _grouped_matmul(e, v.to(dtype))


def _structured_chunk(z, value, dtype, work) -> _Chunk:
    """Causal (or full) structure, no mask tensor, no window: z holds key 0 and the keys every
    row of the chunk sees (no mask work at all); the diagonal block is done apart."""
    first = z[..., 0].clone()  # no view: the chunk's block must not stay alive
    present = torch.ones(1, 1, z.shape[2], dtype=torch.bool, device=z.device)
    if value is not None and z.shape[-1] > 1:  # the output from the same exponentials
        v = value[:, :, 1 : z.shape[-1]].to(dtype)
        core, out = raw_block_sums(z[..., 1:], weigh=lambda e: _grouped_matmul(e, v), work=work)
        return _Chunk(core, _empty(z), first, present, out, core.m)
    return _Chunk(raw_block_sums(z[..., 1:], work=work), _empty(z), first, present)


def _causal_chunk(z, spec: MaskSpec, i0: int, i1: int, work, tails: dict) -> _Chunk:
    """Causal rows, no mask tensor, torch backend, statistics only: z holds key 0 and every key
    some row of the chunk sees. The keys only some rows see (the chunk's diagonal corner, the
    last C - 1 at most) are masked within the block (``raw_block_sums``'s ``tail``; ``tails``
    keeps the masks by shape): no separate pass over the diagonal, whose short rows reduce
    slowly."""
    first = z[..., 0].clone()  # no view: the chunk's block must not stay alive
    present = torch.ones(1, 1, z.shape[2], dtype=torch.bool, device=z.device)
    hi = z.shape[-1]
    if hi < 2:
        return _Chunk(_empty(z), None, first, present)
    s0 = min(max(1, i0 + spec.q_offset + 1), hi)  # the first key that not every row sees
    key = (i1 - i0, hi - s0, i0 + spec.q_offset + 1 - s0)  # the mask depends on these alone
    if key not in tails:
        tails[key] = tail_masks(_index_valid(spec, i0, i1, s0, hi, z.device), z.dtype)  # (1, 1, C, hi - s0)
    return _Chunk(raw_block_sums(z[..., 1:], tail=tails[key], work=work), None, first, present)


def _diagonal(query, key, value, *, scaling, softcap, chunk, off, dtype, work=None):
    """The masked part of causal rows, all chunks at once: query row r of chunk [i0, i1) sees
    keys i0 + off + 1 .. r + off. Returns raw ``Sums`` (B, H, Tq) and, fused, the part's
    e-weighted values (B, H, Tq, Dv)."""
    b, h, tq, d = query.shape
    n_c = -(-tq // chunk)
    hkv = key.shape[1]
    tp = n_c * chunk
    like = query.new_empty((), dtype=dtype)
    # Padded copies in the workspace: fresh (B, H, Tp, D) tensors would fault their pages in
    # on every call. The copy comes first so that the scaling is done in ``dtype``.
    q = take(work, "diag_q", (b, h, tp, d), like)  # (B, H, Tp, D)
    k = take(work, "diag_k", (b, hkv, tp, d), like)  # (B, Hkv, Tp, D)
    q[:, :, :tq].copy_(query)
    k[:, :, :tq].copy_(key[:, :, off : off + tq])
    q[:, :, tq:].zero_()
    k[:, :, tq:].zero_()
    factor = scaling if softcap is None else scaling / softcap
    qg = q.mul_(factor).view(b, hkv, h // hkv, n_c, chunk, d)
    kg = k.view(b, hkv, 1, n_c, chunk, d)
    out = take(work, "diag_logits", (b, hkv, h // hkv, n_c, chunk, chunk), qg)
    z = torch.matmul(qg, kg.transpose(-1, -2), out=out).view(b, h, n_c, chunk, chunk)  # (B, H, nC, C, C)
    if softcap is not None:
        z = z.tanh_().mul_(softcap)
    r = torch.arange(chunk, device=z.device)
    valid = (r.view(1, chunk) >= 1) & (r.view(1, chunk) <= r.view(chunk, 1))  # (C, C): 1 <= t <= row
    out = None
    if value is not None:  # the output from the same exponentials
        v = torch.nn.functional.pad(value[:, :, off : off + tq].to(dtype), (0, 0, 0, tp - tq))
        dv = v.shape[-1]
        vg = v.view(b, hkv, 1, n_c, chunk, dv)

        def weigh(e):  # (B, H, nC, C, C) -> (B, H, Tq, Dv); hidden keys: e <= e^-69
            o = torch.matmul(e.view(b, hkv, h // hkv, n_c, chunk, chunk), vg)
            return o.reshape(b, h, n_c * chunk, dv)[:, :, :tq]

        sums, out = raw_block_sums(z, valid, weigh=weigh, work=work)
    else:
        sums = raw_block_sums(z, valid, work=work)
    return Sums(*(_query_rows(getattr(sums, f), tq) for f in Sums.__dataclass_fields__)), out


def _query_rows(x: torch.Tensor, tq: int) -> torch.Tensor:
    """(B, H, nC, C) -> (B|1, H|1, Tq): a leading dim broadcast by x (stride 0, e.g. the key
    counts) stays size 1."""
    x = x[: 1 if x.stride(0) == 0 else None, : 1 if x.stride(1) == 0 else None]
    return x.reshape(*x.shape[:2], -1)[:, :, :tq]


def _masked_chunk(z, valid, value, dtype, k0, work) -> _Chunk:
    """Any mask: one masked fill; the first visible key of each row is found and left out."""
    idx = valid.to(torch.int8).argmax(-1, keepdim=True)  # (B|1, 1|H, C, 1) first visible
    present = valid.gather(-1, idx).squeeze(-1)
    first = z.gather(-1, idx.expand(*z.shape[:-1], 1)).squeeze(-1)
    first = torch.where(present, first, torch.zeros((), dtype=z.dtype, device=z.device))
    rest_valid = valid.scatter(-1, idx, False)
    rest = raw_block_sums(z, rest_valid, work=work)
    chunk = _Chunk(_empty(z), rest, first, present)
    if value is not None:  # every visible key, first included, relative to their max
        keys = merge_one(normalized(rest), first, present)
        m = torch.where(torch.isfinite(keys.m), keys.m, 0).to(z.dtype)
        zz = z.masked_fill(~valid, 0.0)  # no NaN from hidden keys
        chunk.out, chunk.out_m = _fused_part(zz, m, valid, value[:, :, k0 : k0 + z.shape[-1]], dtype), m
    return chunk


def _cat_rows(xs: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Per-chunk row tensors (B|1, H|1, C), concatenated along the query rows: (B|1, H|1, Tq).
    A leading dim that every part broadcasts (size 1 or stride 0, e.g. the key counts of causal
    rows) stays size 1: concatenating broadcast views is a slow copy, and later per-row
    operations broadcast it for free."""
    lead = tuple(1 if all(x.shape[d] == 1 or x.stride(d) == 0 for x in xs) else shape[d] for d in range(2))
    return torch.cat([x if x.shape[:2] == lead else _lead(x, lead) for x in xs], dim=2)


def _lead(x: torch.Tensor, lead: tuple[int, int]) -> torch.Tensor:
    """x (B|1, H|1, C) as (*lead, C): broadcast dims cut to 1, the others expanded (views)."""
    x = x[: 1 if lead[0] == 1 else None, : 1 if lead[1] == 1 else None]
    return x.expand(*lead, x.shape[2])


def _cat_sums(parts: list[Sums], shape: tuple[int, ...]) -> Sums:
    """Raw per-chunk sums, concatenated along the query rows (``_cat_rows``)."""
    return Sums(*(_cat_rows([getattr(p, f) for p in parts], shape) for f in Sums.__dataclass_fields__))


def _head_sums(core_raw: Sums, edge_raw: Sums | None, first, present, ok, sink, names, n_max=None):
    """The ``SiteSums`` of the statistics ``names`` from the rows' raw sums: core and edge parts
    (B, H, Tq; edge None: none), the first visible key's logit, kept rows ``ok``; ``n_max``
    bounds the rows' key counts (``finish``). Also returns the rows' merged ``Sums``."""
    rest = normalized(core_raw) if edge_raw is None else merge(normalized(core_raw), normalized(edge_raw))
    keys = merge_one(rest, first, present)
    stats = finish(keys, ok, first=first, rest=rest, sink=sink, n_max=n_max)
    return reduce_rows(stats, names, first.shape, 1), keys


@torch.no_grad()
def _chunk_pass(query, k, value, mask: MaskSpec, *, scaling, softcap, bias, chunk: int, dtype, work,
                inline: bool, diagonal: bool, structured: bool) -> list[_Chunk]:
    """The per-chunk sums of every block of query rows (``_run``), in row order; ``k`` the keys
    in the statistics dtype."""
    tq, tk, off = query.shape[2], k.shape[2], mask.q_offset
    chunks: list[_Chunk] = []
    tails: dict = {}  # inline: diagonal masks by shape
    # Longest key ranges first: every later block fits in memory an earlier one freed (the
    # allocator then reuses it instead of growing the heap).
    # Inline, chunk ends sit where a row of keys 1 .. i1 + off - 1 is a whole number of chunks
    # long: reductions over rows whose length is a multiple of the vector width run several
    # times faster than over ragged ones.
    starts = sorted({0, *range((1 - off) % chunk, tq, chunk)}) if inline else list(range(0, tq, chunk))
    for i0, i1 in reversed(list(zip(starts, starts[1:] + [tq], strict=True))):
        # Keys no row of the chunk can see are never multiplied.
        hi = min(tk, i1 + off) if (mask.mask is None and mask.causal) else tk
        if diagonal:
            hi = min(tk, i0 + off + 1)  # the keys every row of the chunk sees
        lo = 0
        if mask.mask is None and mask.sliding_window is not None:
            lo = max(0, min(hi, i0 + off - mask.sliding_window + 1))
        q = query[:, :, i0:i1].to(dtype)
        z = _chunk_logits(q, k[:, :, lo:hi], scaling, softcap, work)  # (B, H, C, hi - lo)
        if bias is not None:
            z = z + bias[:, :, i0:i1, lo:hi].to(dtype)
        if inline:
            ch = _causal_chunk(z, mask, i0, i1, work, tails)
        elif diagonal or (structured and not mask.causal):
            ch = _structured_chunk(z, value, dtype, work)
        else:
            z, valid = _chunk_mask(mask, z, i0, i1, lo, hi)
            ch = _masked_chunk(z, valid, value, dtype, lo, work)
        chunks.append(ch)
    chunks.reverse()
    return chunks


def _run(query, key, value, *, scaling, mask, softcap, row_valid, chunk, dtype, sinks, bias,
         work=None):
    b, h, tq, _ = query.shape
    tk = key.shape[2]
    off = mask.q_offset
    k = key.to(dtype)
    structured = mask.mask is None and mask.sliding_window is None and tk > 0
    # Causal rows without a mask tensor (and no position bias, which would need the blocks'
    # bias slices): statistics alone mask each chunk's diagonal corner in its own block;
    # the fused path batches the diagonal blocks of all chunks apart.
    inline = structured and mask.causal and bias is None and value is None
    diagonal = structured and mask.causal and bias is None and not inline
    chunks = _chunk_pass(query, k, value, mask, scaling=scaling, softcap=softcap, bias=bias, chunk=chunk,
                         dtype=dtype, work=work, inline=inline, diagonal=diagonal, structured=structured)
    core_raw = _cat_sums([c.core for c in chunks], (b, h))  # (B, H, Tq)
    diag_out = None
    if diagonal:
        edge_raw, diag_out = _diagonal(
            query, key, value, scaling=scaling, softcap=softcap, chunk=chunk, off=off, dtype=dtype,
            work=work,
        )
    elif all(c.edge is not None for c in chunks):
        edge_raw = _cat_sums([c.edge for c in chunks], (b, h))
    else:
        edge_raw = None
    first = torch.cat([c.first for c in chunks], dim=2).to(torch.float64)  # (B, H, Tq)
    present = _cat_rows([c.present for c in chunks], (b, h))  # (B|1, H|1, Tq)
    ok = torch.ones(1, 1, tq, dtype=torch.bool, device=query.device)  # broadcast over heads
    if row_valid is not None:
        ok = ok & row_valid.bool().view(b, 1, tq)
    sink = None if sinks is None else _row_sinks(sinks, b, h, tq)  # (B, H, Tq)
    names = attn_metric_names(sinks is not None)
    every = present if not structured else None  # structured: key 0 is in every row
    site, keys = _head_sums(core_raw, edge_raw, first, every, ok, sink, names, n_max=tk)
    out = None
    if value is not None:
        out = _fused_output(chunks, keys, sink, first, present, edge_raw, diag_out, value,
                            query.dtype, chunk=chunk, dtype=dtype, structured=structured)
    return site, out


def _chunk_mask(mask: MaskSpec, z, i0: int, i1: int, lo: int, hi: int):
    """(z with an additive mask tensor added, the keys each row sees (B|1, 1|H, C, hi - lo))
    for query rows [i0, i1) and keys [lo, hi) of a chunk under a mask tensor or a window."""
    if mask.mask is None:
        return z, _index_valid(mask, i0, i1, lo, hi, z.device)
    m = mask.mask[:, :, i0:i1, lo:hi]  # (B, 1|H, C, Tk)
    if m.dtype == torch.bool:
        return z, m
    valid = m > torch.finfo(m.dtype).min / 2
    return z + torch.where(valid, m, torch.zeros((), dtype=m.dtype, device=m.device)).to(z.dtype), valid


def _row_sinks(sinks: torch.Tensor, b: int, h: int, tq: int) -> torch.Tensor:
    """Learned sink logits, (H,) or (B, H, Tq, 1), as float64 (B, H, Tq)."""
    sink = sinks.to(torch.float64)
    sink = sink.view(1, h, 1) if sink.dim() == 1 else sink.reshape(b, h, tq)
    return sink.expand(b, h, tq)


def _fused_output(chunks, keys, sink, first, present, edge_raw, diag_out, value, out_dtype, *,
                  chunk, dtype, structured) -> torch.Tensor:
    """The fused path's attention output (B, Tq, H, Dv) in ``out_dtype``: every chunk's part
    (and key 0's and the diagonal's, when kept apart) rescaled to probabilities by the rows'
    log-sum-exp (keys (B, H, Tq) merged, sink the sink logits or None)."""
    b, h, tq = first.shape
    lse = stats_lse(keys, sink)  # (B, H, Tq)

    def weighted(o, m):  # o relative to e^m, rescaled to probabilities
        return o * (m.to(torch.float64) - lse).exp().to(o.dtype).unsqueeze(-1)

    dv = value.shape[-1]
    out = torch.zeros(b, h, tq, dv, dtype=dtype, device=first.device)
    for i, c in enumerate(chunks):
        if c.out is not None:
            out[:, :, i * chunk : i * chunk + c.out.shape[2]] += c.out
    m_part = torch.cat([c.out_m if c.out_m is not None else torch.full_like(c.first, float("-inf")) for c in chunks], dim=2)
    out = weighted(out, m_part)
    if structured:  # key 0 was kept apart
        out = out + weighted(_grouped_matmul(torch.ones(b, h, tq, 1, dtype=dtype, device=out.device), value[:, :, :1].to(dtype)), first)
    if diag_out is not None:
        out = out + weighted(diag_out, edge_raw.m)
    out = torch.where(present.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    out = out.to(out_dtype).transpose(1, 2).contiguous()  # (B, Tq, H, Dv) like HF
    return out


def stats_lse(keys: Sums, sink: torch.Tensor | None) -> torch.Tensor:
    """log-sum-exp of each row's softmax (keys, and the sink logit when there is one)."""
    soft = keys if sink is None else merge_one(keys, sink)
    return soft.m + soft.s.clamp(min=1e-300).log()


def attention_head_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float,
    mask: MaskSpec,
    softcap: float | None = None,
    row_valid: torch.Tensor | None = None,
    chunk: int = 32,
    dtype: torch.dtype = torch.float32,
    sinks: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    work: Workspace | None = None,
) -> SiteSums:
    """Per-head sums and row counts of every attention statistic, the largest logit and the
    rows' histograms (``SiteSums``).

    Args:
        query: (B, H, Tq, D); key: (B, Hkv, Tk, D) with H a multiple of Hkv.
        row_valid: bool (B, Tq): query rows to count (False for padding queries).
        dtype: precision of the logits and block passes (float64 for exact checks); per-row
            results are float64.
        sinks: learned sink logits, (H,) or (B, H, Tq, 1): one more softmax option per row.
        position_bias: additive (B|1, H, Tq, Tk) bias on the scores, before the mask.
        work: where the block-sized temporaries go (``workspace``; fresh tensors if None).
    """
    site, _ = _run(
        query, key, None, scaling=scaling, mask=mask, softcap=softcap, row_valid=row_valid,
        chunk=chunk, dtype=dtype, sinks=sinks, bias=position_bias, work=work,
    )  # fmt: skip
    return site


def attention_forward_with_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, SiteSums]:
    """The fused path: (attention output (B, Tq, H, Dv) in query's dtype, ``SiteSums``).

    Same arguments as ``attention_head_sums``. The output is softmax(z) @ V from the very
    exponentials the statistics use (the sink takes probability but adds no value); rows with
    no visible key get zeros. Within float rounding of eager attention, not bit-identical."""
    site, out = _run(
        query, key, value, scaling=kwargs.pop("scaling"), mask=kwargs.pop("mask"),
        softcap=kwargs.pop("softcap", None), row_valid=kwargs.pop("row_valid", None),
        chunk=kwargs.pop("chunk", 32), dtype=kwargs.pop("dtype", torch.float32),
        sinks=kwargs.pop("sinks", None), bias=kwargs.pop("position_bias", None),
        work=kwargs.pop("work", None),
    )  # fmt: skip
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    return out, site
