"""Per-head attention statistics in one streaming Triton kernel (the optional GPU fast path).

``kernel_head_sums`` computes the base statistics (``vocab.ATTN_METRICS``, same row validity
as ``attention.attention_head_sums``); ``attention_head_sums_triton`` is the drop-in for
``attention_head_sums`` (every metric: the torch path fills the ones the kernel lacks). One
program per (batch, head, block of query rows)
computes the block's logits against one key block at a time with ``tl.dot`` and folds them into
per-row online recurrences, so no logits matrix is ever written to memory:

* running max ``m``, ``l = sum exp(z - m)`` and ``a = sum exp(z - m) * (z - m)`` (rescaled when
  ``m`` grows), giving ``entropy = log l - a / l``, ``max_prob = 1 / l``;
* count ``n``, mean and centred sum of squares merged block by block (Chan et al.), measured
  from the first valid key's logit, so std and max - mean stay accurate in float32 when
  ``|mean| >> std``;
* the two largest logits (ties count twice, as ``topk`` does) and the first valid key's logit.

Each program then reduces its rows to per-metric sums and counts (float32, at most one block of
rows each) and writes them to a small buffer that torch sums per head in float64.

Masks: ``MaskSpec`` with no tensor (causal / sliding window by index, ``q_offset``; key blocks
outside the band are never visited), a bool mask or an additive float mask of shape
(B | 1, 1 | H, >= Tq, >= Tk) read through its strides (entries <= finfo.min / 2 are masked);
with a mask tensor, key blocks with no visible key are skipped after reading the mask tile.
Grouped-query heads use kv head ``h // (H // Hkv)``. Logits are accumulated in float32 for
float16, bfloat16 and float32 inputs (float32 q/k multiply as three-pass TF32 by default, see
``LaunchConfig``; never plain TF32). A float64 request (``dtype=torch.float64``) is served by
the torch reference path.

Importing this module needs triton (``pip install triton``); the hooks import it lazily. CUDA
tensors run compiled; CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1`` in
the environment before triton is first imported), which is how the parity tests run without a
GPU. The interpreter's ``tl.dot`` mishandles bfloat16, so there the q/k tiles are upcast first.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..vocab import ATTN_METRICS
from .attention import MaskSpec, attention_head_sums

_N_METRICS = 8
if len(ATTN_METRICS) != _N_METRICS:  # the kernel writes the metrics in ATTN_METRICS order
    raise RuntimeError("triton_kernel.py is out of date with vocab.ATTN_METRICS")


class TritonKernelError(ValueError):
    """Inputs the Triton kernel cannot take (wrong shapes, CPU tensors without the interpreter)."""


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: keys per block, the compiler's warps and pipeline stages, and how float32
    q/k enter the tensor cores ("tf32x3": three TF32 products, about float32 accuracy;
    "ieee": exact float32 FMA, far slower and spills registers on sm_90)."""

    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    fp32_precision: str = "tf32x3"


_override: LaunchConfig | None = None


def launch_config() -> LaunchConfig:
    """The launch every call uses: ``LaunchConfig()`` unless ``set_launch_config`` overrides it.

    The defaults were chosen from ptxas register counts for sm_90, not from timings (no GPU
    was available; ``benchmarks/gpu.py --sweep`` times alternatives): no spills at head dim 64
    and 128 with the structure given by index (bf16 or float32 q/k), 16-40 bytes of stack with
    a mask tensor. The interpreter ignores warps and stages and multiplies in float32.
    """
    return _override if _override is not None else LaunchConfig()


def set_launch_config(config: LaunchConfig | None) -> None:
    """Force one launch configuration for every call (None restores the defaults)."""
    global _override
    if config is not None:
        if config.block_n < 16 or config.block_n & (config.block_n - 1):
            raise TritonKernelError(f"block_n must be a power of two >= 16, got {config.block_n}")
        if config.fp32_precision not in ("tf32x3", "ieee"):
            raise TritonKernelError(
                f"fp32_precision must be 'tf32x3' or 'ieee', got {config.fp32_precision!r}"
            )
    _override = config


def _head_stats_kernel(
    q_ptr, k_ptr, mask_ptr, rowv_ptr, out_ptr,
    H, G, Tq, Tk, D,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    smb, smh, smq, smk,
    srb, srt,
    scaling, softcap, lowest, q_offset, window,
    MASK_KIND: tl.constexpr,  # 0: by index (causal / window), 1: bool, 2: additive float
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ROWV: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast q, k tiles before the dot (the interpreter's dot needs it)
    DOT_PRECISION: tl.constexpr,  # float32 operands: "ieee" or "tf32x3"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) query blocks first
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kvh = h // G

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,) query rows
    offs_d = tl.arange(0, BLOCK_D)  # (Dp,)
    in_q = offs_m < Tq
    q_ptrs = q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=in_q[:, None] & (offs_d < D)[None, :], other=0.0)  # (M, Dp)
    if DOT_FP32:
        q = q.to(tl.float32)

    row_ok = in_q
    if HAS_ROWV:
        rv = tl.load(rowv_ptr + b * srb + offs_m * srt, mask=in_q, other=0)
        row_ok = row_ok & (rv != 0)

    # Structure by index: row r sees keys [k_lo[r], k_hi[r]); only blocks in the band are visited.
    lo = 0
    hi = Tk
    if MASK_KIND == 0:
        qpos = offs_m + q_offset  # (M,)
        k_lo = tl.zeros((BLOCK_M,), tl.int32)
        k_hi = tl.full((BLOCK_M,), Tk, tl.int32)
        last_first = 0  # the largest k_lo of the block: no first key lies beyond it
        if CAUSAL:
            k_hi = tl.minimum(k_hi, qpos + 1)
            hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M + q_offset)
        if HAS_WINDOW:
            k_lo = tl.maximum(k_lo, qpos - window + 1)
            lo = tl.maximum(0, pid_m * BLOCK_M + q_offset - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
            last_first = (pid_m + 1) * BLOCK_M - 1 + q_offset - window + 1

    neg_inf = float("-inf")
    m_i = tl.full((BLOCK_M,), neg_inf, tl.float32)  # running max (= top-1 logit)
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # sum exp(z - m)
    a_i = tl.zeros((BLOCK_M,), tl.float32)  # sum exp(z - m) * (z - m)
    n_i = tl.zeros((BLOCK_M,), tl.float32)  # valid keys
    mean_i = tl.zeros((BLOCK_M,), tl.float32)  # mean logit minus the first key's logit
    m2_i = tl.zeros((BLOCK_M,), tl.float32)  # sum (z - mean)^2
    t2_i = tl.full((BLOCK_M,), neg_inf, tl.float32)  # second largest logit
    f_i = tl.zeros((BLOCK_M,), tl.float32)  # logit of the first valid key

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (N,) keys
        if MASK_KIND == 0:
            valid = (offs_n[None, :] >= k_lo[:, None]) & (offs_n[None, :] < k_hi[:, None])
            valid = valid & row_ok[:, None]  # (M, N)
            seen = tl.minimum(k_hi, start_n + BLOCK_N) - tl.maximum(k_lo, start_n)
            nb = tl.where(row_ok, tl.maximum(seen, 0), 0).to(tl.float32)  # (M,) valid keys
            need_first = start_n <= last_first
            do_tile = True
        else:
            valid = row_ok[:, None] & (offs_n < Tk)[None, :]  # (M, N)
            m_ptrs = mask_ptr + b * smb + h * smh + offs_m[:, None] * smq + offs_n[None, :] * smk
            mval = tl.load(m_ptrs, mask=valid, other=0)  # (M, N)
            if MASK_KIND == 1:
                valid = valid & (mval != 0)
            else:
                mval = mval.to(tl.float32)
                valid = valid & (mval > lowest)
            nb = tl.sum(valid.to(tl.float32), 1)  # (M,) valid keys
            need_first = tl.max(((n_i == 0) & (nb > 0)).to(tl.int32)) > 0
            do_tile = tl.max(nb) > 0  # skip key blocks the mask hides entirely
        if do_tile:
            k_ptrs = k_ptr + b * skb + kvh * skh + offs_n[None, :] * skt + offs_d[:, None] * skd
            kt = tl.load(k_ptrs, mask=(offs_n < Tk)[None, :] & (offs_d < D)[:, None], other=0.0)
            if DOT_FP32:
                kt = kt.to(tl.float32)  # (Dp, N)
            z = tl.dot(q, kt, input_precision=DOT_PRECISION) * scaling  # (M, N) float32
            if HAS_SOFTCAP:
                # tanh from exp (no tanh in core triton): odd, Taylor series near 0.
                x = z / softcap
                ax = tl.abs(x)
                e = tl.exp(-2.0 * ax)
                th = (1.0 - e) / (1.0 + e)
                x2 = x * x
                series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
                th = tl.where(ax < 0.2, series, th)
                z = tl.where(x < 0, -th, th) * softcap
            if MASK_KIND == 2:
                z = z + mval
            # Invalid entries only ever enter through `where` (padding keys may hold NaN).
            zm = tl.where(valid, z, neg_inf)  # (M, N)
            t1b = tl.max(zm, 1)  # (M,) block maximum

            # the first valid key's logit, in the block where the row sees its first key
            if need_first:
                if MASK_KIND == 0:
                    first_col = k_lo
                else:
                    first_col = tl.min(tl.where(valid, offs_n[None, :], hi + BLOCK_N), 1)
                zfirst = tl.sum(tl.where(offs_n[None, :] == first_col[:, None], zm, 0.0), 1)
                f_i = tl.where((n_i == 0) & (nb > 0), zfirst, f_i)

            # top-2: the block's second largest counts a tied maximum twice
            n_top = tl.sum((zm == t1b[:, None]).to(tl.float32), 1)
            rest = tl.max(tl.where(zm < t1b[:, None], zm, neg_inf), 1)
            t2b = tl.where(n_top >= 2.0, t1b, rest)
            t2_i = tl.maximum(tl.minimum(m_i, t1b), tl.maximum(t2_i, t2b))

            # online softmax: l = sum exp(z - m), a = sum exp(z - m) (z - m)
            m_new = tl.maximum(m_i, t1b)
            m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)  # 0 while the row was empty
            shift = tl.where(m_i == neg_inf, 0.0, m_i - m_safe)
            zc = tl.maximum(zm - m_safe[:, None], -1e30)  # -1e30 where invalid: p = 0, p*zc = 0
            p = tl.exp(zc)
            a_i = alpha * (a_i + l_i * shift) + tl.sum(p * zc, 1)
            l_i = alpha * l_i + tl.sum(p, 1)
            m_i = m_new

            # mean and centred sum of squares, merged with the block's (Chan et al.), all
            # relative to the first valid key's logit, so |mean| >> std costs no precision
            zs = tl.where(valid, z - f_i[:, None], 0.0)
            mean_b = tl.sum(zs, 1) / tl.maximum(nb, 1.0)
            dz = tl.where(valid, zs - mean_b[:, None], 0.0)
            m2_b = tl.sum(dz * dz, 1)
            n_new = n_i + nb
            w_b = nb / tl.maximum(n_new, 1.0)
            delta = mean_b - mean_i
            mean_i = mean_i + delta * w_b
            m2_i = m2_i + m2_b + delta * delta * n_i * w_b
            n_i = n_new

    ok = n_i > 0
    two = n_i > 1
    nf = tl.maximum(n_i, 1.0)
    l_safe = tl.where(ok, l_i, 1.0)
    m_fin = tl.where(ok, m_i, 0.0)
    log_n = tl.log(nf)
    entropy = tl.log(l_safe) - a_i / l_safe
    std = tl.sqrt(tl.maximum(m2_i / nf, 0.0))
    okf = ok.to(tl.float32)
    twof = two.to(tl.float32)
    base = out_ptr + (pid_bh * tl.num_programs(1) + pid_m) * (2 * 8)
    # sums, in ATTN_METRICS order, then counts
    tl.store(base + 0, tl.sum(tl.where(ok, entropy, 0.0), 0))
    tl.store(base + 1, tl.sum(tl.where(two, entropy / tl.where(two, log_n, 1.0), 0.0), 0))
    tl.store(base + 2, tl.sum(tl.where(ok, 1.0 / l_safe, 0.0), 0))
    tl.store(base + 3, tl.sum(tl.where(ok, std, 0.0), 0))
    tl.store(base + 4, tl.sum(tl.where(ok, (m_fin - f_i) - mean_i, 0.0), 0))
    tl.store(base + 5, tl.sum(tl.where(two, m_fin - t2_i, 0.0), 0))
    peaked = ok & (std > tl.sqrt(2.0 * log_n))
    tl.store(base + 6, tl.sum(peaked.to(tl.float32), 0))
    tl.store(base + 7, tl.sum(tl.where(ok, tl.exp(f_i - m_fin) / l_safe, 0.0), 0))
    n_ok = tl.sum(okf, 0)
    n_two = tl.sum(twof, 0)
    tl.store(base + 8, n_ok)
    tl.store(base + 9, n_two)
    for j in tl.static_range(10, 13):
        tl.store(base + j, n_ok)
    tl.store(base + 13, n_two)
    tl.store(base + 14, n_ok)
    tl.store(base + 15, n_ok)


#: True when triton.language was loaded under TRITON_INTERPRET=1. The interpreter swaps the
#: language's own jitted functions at import, so the mode is fixed for the process.
INTERPRETED = not isinstance(tl.sum, triton.JITFunction)
_kernel_fn = None


def _kernel():
    """The jitted kernel, built on first use (in the mode triton was imported in)."""
    global _kernel_fn
    if _kernel_fn is None:
        if bool(triton.knobs.runtime.interpret) != INTERPRETED:
            raise TritonKernelError(
                "TRITON_INTERPRET changed after triton was imported: set it before the process "
                "first imports triton"
            )
        _kernel_fn = triton.jit(_head_stats_kernel)
    return _kernel_fn


def _block_m(chunk: int) -> int:
    """Query rows per program: ``chunk`` rounded up to a power of two in [16, 128]."""
    return min(128, max(16, triton.next_power_of_2(max(1, int(chunk)))))


def _mask_operand(mask: torch.Tensor, b: int, h: int, tq: int, tk: int):
    """(tensor the kernel reads, kind, lowest unmasked value, strides (b, h, q, k))."""
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h):
        raise TritonKernelError(
            f"attention mask of shape {tuple(mask.shape)} is not (B|1, 1|H, Tq, Tk) for B={b}, "
            f"H={h}; pass a 4-D mask or use backend='torch'"
        )
    if mask.shape[2] < tq or mask.shape[3] < tk:
        raise TritonKernelError(
            f"attention mask of shape {tuple(mask.shape)} is smaller than Tq={tq}, Tk={tk}"
        )
    if mask.dtype == torch.bool:
        m, kind, lowest = mask.view(torch.uint8), 1, 0.0
    elif mask.dtype in (torch.float16, torch.bfloat16, torch.float32):
        m, kind, lowest = mask, 2, torch.finfo(mask.dtype).min / 2
    elif mask.dtype == torch.float64:
        # Read as float32 (a copy); masked entries become -inf so the float32 threshold still
        # sees them (a visible entry below the float32 range would be hidden: not a real mask).
        valid = mask > torch.finfo(torch.float64).min / 2
        neg = torch.full((), float("-inf"), dtype=torch.float32, device=mask.device)
        m, kind, lowest = (
            torch.where(valid, mask.float(), neg),
            2,
            torch.finfo(torch.float32).min / 2,
        )
    else:
        raise TritonKernelError(f"attention mask dtype {mask.dtype} is not bool or float")
    strides = [0 if m.shape[i] == 1 else m.stride(i) for i in range(4)]
    return m, kind, float(lowest), strides


def _operands(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in one dtype the kernel's dot takes (float16/bfloat16 kept, else float32)."""
    if query.dtype == key.dtype and query.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return query, key
    return query.to(torch.float32), key.to(torch.float32)


@torch.no_grad()
def attention_head_sums_triton(
    query: torch.Tensor, key: torch.Tensor, **options: Any
) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor]:
    """Drop-in for ``attention_head_sums`` (the same arguments): every attention statistic, the
    base ones (``vocab.ATTN_METRICS``) from the kernel.

    The kernel does not compute the entropy-equivalent peakedness, the ``_xsink`` statistics,
    learned sinks or a position bias: the torch path fills those (so this costs the torch
    path plus the kernel), and runs alone for sinks, a position bias or a float64 request."""
    kernel = None
    extra = {name: options.pop(name, None) for name in ("sinks", "position_bias")}
    if options.get("dtype", torch.float32) != torch.float64 and not any(v is not None for v in extra.values()):
        kernel = kernel_head_sums(query, key, **options)  # first: it checks the inputs
    names, sums, counts = attention_head_sums(query, key, **options, **extra)
    if kernel is not None:
        cols = [names.index(name) for name in ATTN_METRICS]
        sums[:, cols] = kernel[1].to(sums.device)
        counts[:, cols] = kernel[2].to(counts.device)
    return names, sums, counts


@torch.no_grad()
def kernel_head_sums(
    query: torch.Tensor, key: torch.Tensor, *, scaling: float, mask: MaskSpec,
    softcap: float | None = None, row_valid: torch.Tensor | None = None, chunk: int = 32,
    dtype: torch.dtype = torch.float32,
) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor]:
    """Per-head sums and row counts of the base attention statistics, from one Triton kernel.

    Same inputs as ``attention_head_sums``: query (B, H, Tq, D), key (B, Hkv, Tk, D) with H a
    multiple of Hkv, row_valid bool (B, Tq); returns (vocab.ATTN_METRICS, sums (H, M) float64,
    counts (H, M) float64). ``chunk`` sets the query rows per program (rounded up to a power
    of two in [16, 128]). ``dtype=torch.float64`` falls back to the torch path; any other
    dtype than float32 is refused. Logits and statistics are computed in float32.
    """
    if dtype == torch.float64:
        names, sums, counts = attention_head_sums(
            query, key, scaling=scaling, mask=mask, softcap=softcap, row_valid=row_valid,
            chunk=chunk, dtype=dtype,
        )  # fmt: skip
        cols = [names.index(name) for name in ATTN_METRICS]
        return ATTN_METRICS, sums[:, cols], counts[:, cols]
    if dtype != torch.float32:
        raise TritonKernelError(f"the Triton kernel computes in float32 or float64, not {dtype}")
    if query.dim() != 4 or key.dim() != 4:
        raise TritonKernelError("query and key must be (B, H, T, D) tensors")
    b, h, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if key.shape[0] != b or key.shape[3] != d or hkv == 0 or h % hkv != 0:
        raise TritonKernelError(
            f"key {tuple(key.shape)} does not match query {tuple(query.shape)} "
            "(same batch and head dim, query heads a multiple of key heads)"
        )
    if not query.is_cuda and not INTERPRETED:
        raise TritonKernelError(
            "the Triton kernel runs on CPU tensors only under Triton's interpreter: start Python "
            "with TRITON_INTERPRET=1 (set before triton is imported), or use backend='torch'"
        )
    sums = torch.zeros(h, _N_METRICS, dtype=torch.float64, device=query.device)
    counts = torch.zeros_like(sums)
    if b == 0 or tq == 0 or tk == 0:
        return ATTN_METRICS, sums, counts

    q, k = _operands(query, key)
    cfg = launch_config()
    block_m = _block_m(chunk)
    block_d = max(16, triton.next_power_of_2(d))
    n_mb = triton.cdiv(tq, block_m)
    out = torch.empty(b * h * n_mb, 2 * _N_METRICS, dtype=torch.float32, device=q.device)

    if mask.mask is None:
        m_t, kind, lowest, m_strides = q, 0, 0.0, [0, 0, 0, 0]
    else:
        m_t, kind, lowest, m_strides = _mask_operand(mask.mask.to(q.device), b, h, tq, tk)
    if row_valid is None:
        rv, rv_strides = q, [0, 0]
    else:
        if row_valid.shape != (b, tq):
            raise TritonKernelError(
                f"row_valid {tuple(row_valid.shape)} is not (B, Tq) = {(b, tq)}"
            )
        rv = row_valid.to(q.device).bool().view(torch.uint8)
        rv_strides = [rv.stride(0), rv.stride(1)]
    window = mask.sliding_window
    has_window = kind == 0 and window is not None
    fp32_tc = q.dtype == torch.float32 and not INTERPRETED  # float32 through the tensor cores

    with torch.cuda.device(q.device) if q.is_cuda else nullcontext():
        _kernel()[(b * h, n_mb)](
            q, k, m_t, rv, out,
            h, h // hkv, tq, tk, d,
            *q.stride(), *k.stride(), *m_strides, *rv_strides,
            float(scaling), float(softcap) if softcap is not None else 1.0, lowest,
            int(mask.q_offset), int(window) if has_window else 0,
            MASK_KIND=kind, CAUSAL=bool(mask.causal) and kind == 0, HAS_WINDOW=has_window,
            HAS_SOFTCAP=softcap is not None, HAS_ROWV=row_valid is not None,
            DOT_FP32=INTERPRETED,
            DOT_PRECISION=cfg.fp32_precision if fp32_tc else "ieee",
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    part = out.view(b, h, n_mb, 2, _N_METRICS).to(torch.float64).sum(dim=(0, 2))  # (H, 2, M)
    sums += part[:, 0]
    counts += part[:, 1]
    return ATTN_METRICS, sums, counts
