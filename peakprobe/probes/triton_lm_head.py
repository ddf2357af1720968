"""The LM head's per-position sums from one Triton pass over the logits (the GPU fast path).

``lm_head_sums`` reads the logits (B, T, V) once, in their own dtype (bfloat16, float16 or
float32), and returns per position the mergeable ``sums.Sums`` over the vocabulary and the
target token's logit: what ``rows.finish`` turns into every LM-head statistic, exactly as on
the torch path (``hooks.engine.SiteStats.lm_head``), which stays the reference. Nothing is
written per logit: the kernel writes 8 float32 per position, so the LM head moves the logits'
own bytes (2 per logit in bfloat16) and a few bytes per position.

One program per block of BLOCK_R positions walks the vocabulary in tiles of BLOCK_V logits,
online, with d = z - f relative to the position's first logit f (so float32 sums of
differences of comparable logits):

* the running max m of d (one row reduction per tile) and the online-softmax sums
  ``se = sum 2^x`` and ``sx = sum 2^x x`` with x = (d - m) log2(e), the shift folded into one
  FMA (x = d log2(e) - m log2(e)), rescaled when m grows;
* ``s1 = sum d`` and ``s2 = sum d^2`` per lane (elementwise adds, reduced once at the end);
* a running top two per lane (the second largest logit; a tied maximum counts twice, as
  ``topk``).

The vocabulary's last, partial tile is the only masked one. The target logit is one load per
position. The host turns the record into float64 ``Sums`` relative to the max (``_sums``).

Importing this module needs triton; the engine imports it lazily. CUDA tensors run compiled;
CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``), as the parity tests run.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from .. import vocab
from .sums import Sums


class LmHeadKernelError(vocab.PeakprobeError):
    """Inputs the LM-head kernel cannot take (shapes, dtypes, CPU tensors without the interpreter)."""


#: True when triton.language was loaded under TRITON_INTERPRET=1 (fixed for the process)
INTERPRETED = not isinstance(tl.sum, triton.JITFunction)

LOG2E: tl.constexpr = tl.constexpr(1 / math.log(2))
#: per position: f, max d, second max d, sum 2^x, sum 2^x x, sum d, sum d^2, target logit
FIELDS = 8
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: (logit bytes) -> (positions, vocabulary tile, warps): 16 KiB of logits per tile in flight
_LAUNCH = {2: (4, 1024, 4), 4: (4, 512, 4)}


@triton.jit
def _tile(row_ptr, v0, cols, in_r, f, V, m, se, sx, s1, s2, t1, t2, MASKED: tl.constexpr):
    """Fold logits v0 .. v0 + BLOCK_V of each position into its online sums. MASKED: the
    vocabulary's partial last tile (logits from V on do not count)."""
    ptrs = row_ptr[:, None] + (v0 + cols)[None, :]  # (R, V)
    if MASKED:
        ok = in_r[:, None] & ((v0 + cols) < V)[None, :]
        d0 = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) - f[:, None]
        d = tl.where(ok, d0, float("-inf"))
        dz = tl.where(ok, d0, 0.0)
    else:
        d = tl.load(ptrs, mask=in_r[:, None], other=0.0).to(tl.float32) - f[:, None]
        dz = d
    s1 += dz
    s2 += dz * dz
    t2 = tl.maximum(t2, tl.minimum(t1, d))
    t1 = tl.maximum(t1, d)
    m_new = tl.maximum(m, tl.max(d, 1))  # finite: every tile holds a logit of each position
    shift = tl.where(m == float("-inf"), 0.0, (m - m_new) * LOG2E)  # <= 0
    alpha = tl.exp2(shift)
    x = d * LOG2E - (m_new * LOG2E)[:, None]  # the shift folded into one FMA per logit
    p = tl.exp2(x)
    if MASKED:
        px = tl.where(ok, p * x, 0.0)  # no 0 * -inf
    else:
        px = p * x
    sx = alpha * (sx + shift * se) + tl.sum(px, 1)
    se = alpha * se + tl.sum(p, 1)
    return m_new, se, sx, s1, s2, t1, t2


@triton.jit
def lm_head_kernel(z_ptr, t_ptr, out_ptr, R, V, szr, stt,
                   BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # (R,)
    in_r = rows < R
    row_ptr = z_ptr + rows.to(tl.int64) * szr  # (R,)
    f = tl.load(row_ptr, mask=in_r, other=0.0).to(tl.float32)  # the first logit
    cols = tl.arange(0, BLOCK_V)  # (V,)
    neg_inf = float("-inf")
    m = tl.full((BLOCK_R,), neg_inf, tl.float32)  # max d so far
    se = tl.zeros((BLOCK_R,), tl.float32)  # sum 2^x, x = (d - m) log2 e
    sx = tl.zeros((BLOCK_R,), tl.float32)  # sum 2^x x
    s1 = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)  # per lane: sum d
    s2 = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)  # per lane: sum d^2
    t1 = tl.full((BLOCK_R, BLOCK_V), neg_inf, tl.float32)  # per lane: largest d
    t2 = tl.full((BLOCK_R, BLOCK_V), neg_inf, tl.float32)  # per lane: second largest d
    v_full = (V // BLOCK_V) * BLOCK_V
    for v0 in range(0, v_full, BLOCK_V):
        m, se, sx, s1, s2, t1, t2 = _tile(row_ptr, v0, cols, in_r, f, V, m, se, sx, s1, s2, t1, t2, False)
    for v0 in range(v_full, V, BLOCK_V):
        m, se, sx, s1, s2, t1, t2 = _tile(row_ptr, v0, cols, in_r, f, V, m, se, sx, s1, s2, t1, t2, True)
    ties = tl.sum(tl.where(t1 == m[:, None], 1.0, 0.0), 1)
    other = tl.max(tl.where(t1 < m[:, None], t1, neg_inf), 1)
    m2 = tl.where(ties >= 2.0, m, tl.maximum(other, tl.max(t2, 1)))
    t = tl.load(t_ptr + rows.to(tl.int64) * stt, mask=in_r, other=-1)
    zt = tl.load(row_ptr + tl.maximum(t, 0), mask=in_r & (t >= 0), other=float("nan")).to(tl.float32)
    zt = tl.where(t >= 0, zt, float("nan"))
    base = out_ptr + rows.to(tl.int64) * 8
    tl.store(base + 0, f, mask=in_r)
    tl.store(base + 1, m, mask=in_r)
    tl.store(base + 2, m2, mask=in_r)
    tl.store(base + 3, se, mask=in_r)
    tl.store(base + 4, sx, mask=in_r)
    tl.store(base + 5, tl.sum(s1, 1), mask=in_r)
    tl.store(base + 6, tl.sum(s2, 1), mask=in_r)
    tl.store(base + 7, zt, mask=in_r)


def lm_head_supported(logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``lm_head_sums`` takes these logits (host-only: metadata): (B, T, V) of
    float16, bfloat16 or float32 with V >= 2, on CUDA (or on CPU under the interpreter),
    statistics not asked for in float64."""
    ok_device = logits.device.type == "cuda" or (logits.device.type == "cpu" and INTERPRETED)
    return (dtype == torch.float32 and logits.dim() == 3 and logits.dtype in _DTYPES
            and logits.shape[-1] >= 2 and ok_device)  # fmt: skip


def launch(dtype: torch.dtype) -> dict:
    """The kernel's constexprs and launch options for logits of ``dtype``."""
    rows, tile, warps = _LAUNCH[torch.empty((), dtype=dtype).element_size()]
    return {"BLOCK_R": rows, "BLOCK_V": tile, "num_warps": warps}


@torch.no_grad()
def lm_head_record(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 record (B*T, FIELDS) of logits (B, T, V) against the next-token
    ``target`` (B, T) int64 (-1: none)."""
    if not lm_head_supported(logits):
        raise LmHeadKernelError(
            f"the LM-head kernel takes (B, T, V >= 2) float16 / bfloat16 / float32 logits on CUDA "
            f"(on CPU under TRITON_INTERPRET=1), got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
    b, t, v = logits.shape
    if target.shape != (b, t) or target.device != logits.device:
        raise LmHeadKernelError(f"target must be (B, T) = {(b, t)} on {logits.device}, got "
                                f"{tuple(target.shape)} on {target.device}")  # fmt: skip
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    z = z.reshape(b * t, v)  # a view when (B, T) are contiguous over rows
    tg = target.reshape(b * t).to(torch.int64)
    out = torch.empty(b * t, FIELDS, dtype=torch.float32, device=logits.device)
    opts = launch(logits.dtype)
    if b * t:
        with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
            lm_head_kernel[(triton.cdiv(b * t, opts["BLOCK_R"]),)](
                z, tg, out, b * t, v, z.stride(0), tg.stride(0), **opts)  # fmt: skip
    return out


def _sums(rec: torch.Tensor, v: int, shape: tuple[int, ...]) -> tuple[Sums, torch.Tensor]:
    """float64 ``Sums`` relative to each position's max, and the target logit (NaN: none)."""
    r = rec.to(torch.float64)
    f, m, m2, se, sx, s1, s2, zt = r.unbind(-1)
    n = torch.full((), float(v), dtype=torch.float64, device=rec.device)
    keys = Sums(
        n=n.expand(shape),
        m=(f + m).view(shape),
        m2=(f + m2).view(shape),
        s=se.view(shape),
        a=(sx * math.log(2.0)).view(shape),  # sum e^(z - max) (z - max)
        d1=(s1 - n * m).view(shape),  # sum (z - max)
        d2=(s2 - 2.0 * m * s1 + n * m * m).view(shape),  # sum (z - max)^2
    )
    return keys, zt.view(shape)


def lm_head_sums(logits: torch.Tensor, target: torch.Tensor) -> tuple[Sums, torch.Tensor]:
    """(``Sums`` over the vocabulary per position (B, T), float64; the target token's logit
    (B, T) float64, NaN where ``target`` is -1) of logits (B, T, V), from one kernel pass."""
    b, t, v = logits.shape
    return _sums(lm_head_record(logits, target), v, (b, t))
