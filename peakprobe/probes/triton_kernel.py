"""Every per-head attention statistic of one layer from one Triton launch (the GPU fast path).

``kernel_site_sums`` returns the layer's ``accumulate.SiteSums`` (the row statistics of
``rows.attn_metric_names``, the largest logit, the entropy and max_prob histograms) for query
(B, H, Tq, D) and key (B, Hkv, Tk, D) states, with the keys each query row sees given as a
range [start, end) per row: causal attention, left or right padding, sliding windows and
packed documents are all such ranges (the caller builds them). The kernel is
``triton_site.site_kernel`` (its docstring describes the algorithm); this module checks the
inputs, picks the launch configuration, describes the key tiles for TMA, keeps the device
tables, launches, and sums the per-program records per head in float64 on the device. Nothing
here reads a tensor's values on the host: a call makes no host synchronisation.

Precision: q and k are read as stored (float16, bfloat16 or float32) and multiplied with
float32 accumulation (float32 operands as three-pass TF32, about float32 accuracy: plain IEEE
float32 would not use the tensor cores, one pass of TF32 loses 3 decimal digits); the online
sums and the per-row statistics are float32, the per-head sums float64. Tolerances against a
float64 evaluation of the same q/k (``tests/probes/test_triton_parity.py``), per-head means, by q/k
dtype: float32, bfloat16 and float16 alike 2e-5 relative (half-precision values are exact in
float32; the error is float32 accumulation; observed under the interpreter: at most 3e-7),
beta_eff 2e-4 (its inversion amplifies the entropy's rounding for near-uniform rows; observed
9e-7); compiled float32 q/k 1e-4 (three-pass TF32). The 0/1 flags agree unless a row sits within
rounding of its threshold; the largest logit is the float32 logit (exact when q.k and the scaling
are); a row within rounding of a histogram bin edge may land in the neighbouring bin.

Importing this module needs triton; the hooks import it lazily. CUDA tensors run compiled;
CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported), which is how the parity tests run without a GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import vocab
from . import gaussian_entropy as ge
from .accumulate import SiteSums
from .rows import attn_metric_names
from .triton_site import MAX_COL, N_VALUES, RECORD, VALUES, site_kernel

if (attn_metric_names(True) != VALUES or vocab.QUANTILE_OF != (vocab.ENTROPY, vocab.MAX_PROB)
        or vocab.HIST_BINS & (vocab.HIST_BINS - 1)):  # fmt: skip
    raise RuntimeError("triton_site.py is out of date with rows.attn_metric_names / vocab "
                       "(or vocab.HIST_BINS is not a power of two)")  # fmt: skip

_HALF = (torch.float16, torch.bfloat16)
_DTYPES = (*_HALF, torch.float32)
_MAX_HEAD_DIM = 256


class TritonKernelError(vocab.PeakprobeError):
    """Inputs the Triton kernel cannot take (shapes, dtypes, CPU tensors without the interpreter)."""


#: True when triton.language was loaded under TRITON_INTERPRET=1. The interpreter swaps the
#: language's own jitted functions at import, so the mode is fixed for the process.
INTERPRETED = not isinstance(tl.sum, triton.JITFunction)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: query rows and keys per program tile, the compiler's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: (operand bytes, padded head dim) -> launch; a pair not listed is not supported (float32
#: q/k of head dim above 64: their three-pass TF32 operands overflow the registers under triton 3.6). Chosen
#: from ptxas register counts for sm_90 (``benchmarks/kernel_aot.py``: no spills, tensor-core
#: MMA, shared memory within the 227 KiB of an sm_90 block), not from timings.
_CONFIGS: dict[tuple[int, int], LaunchConfig] = {
    (2, 64): LaunchConfig(128, 128, 8, 2),
    (2, 128): LaunchConfig(128, 128, 8, 2),
    (2, 256): LaunchConfig(64, 64, 8, 2),
    (4, 64): LaunchConfig(128, 64, 8, 2),
}
_override: LaunchConfig | None = None


def block_d(head_dim: int) -> int:
    """The head dim padded for ``tl.dot``: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def _config_key(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    return (2 if dtype in _HALF else 4, max(64, block_d(head_dim)))


def launch_config(dtype: torch.dtype, head_dim: int) -> LaunchConfig:
    """The launch for q/k of ``dtype`` and ``head_dim``, unless ``set_launch_config`` forces one."""
    if _override is not None:
        return _override
    return _CONFIGS[_config_key(dtype, head_dim)]


def set_launch_config(config: LaunchConfig | None) -> None:
    """Force one launch configuration for every call (None restores the defaults)."""
    global _override
    if config is not None:
        for name in ("block_m", "block_n"):
            v = getattr(config, name)
            if v < 16 or v & (v - 1):
                raise TritonKernelError(f"{name} must be a power of two >= 16, got {v}")
    _override = config


def compile_options(dtype: torch.dtype, head_dim: int) -> tuple[dict, dict]:
    """(constexprs, launch options) of the kernel for q/k of ``dtype`` and ``head_dim``, without
    softcapping (``SOFTCAP=True`` is the other variant): what ``kernel_site_sums`` launches with,
    for ahead-of-time compilation."""
    cfg = launch_config(dtype, head_dim)
    bd = block_d(head_dim)
    consts = dict(
        SOFTCAP=False, EVEN_D=bd == head_dim, DOT_FP32=INTERPRETED,
        DOT_PRECISION="tf32x3" if dtype == torch.float32 and not INTERPRETED else "ieee",
        CELLS=ge._CELLS, STEPS=ge._bracket_steps(), BINS=vocab.HIST_BINS,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd,
    )  # fmt: skip
    return consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


# -- device tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tables:
    """float32 copies of ``gaussian_entropy``'s per-n tables and brackets, on one device."""

    size: int
    stride: int
    nb: int
    curves: torch.Tensor  # float32 ((size + 1) * stride,)
    cell_base: torch.Tensor  # int32 (size + 1,)
    lo: torch.Tensor  # int32 brackets' low knots
    b_grid: torch.Tensor  # float32 (nb,)


_TABLES: dict[tuple[int, torch.device], _Tables] = {}
_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(n_max: int, device: torch.device) -> _Tables:
    """Tables for option counts up to n_max on ``device``: built once per (size, device)."""
    size = max(1024, 1 << max(0, n_max - 1).bit_length())  # as ``per_n_tables``
    key = (size, device)
    if key not in _TABLES:
        t = ge.per_n_tables(size, "cpu")
        _, b_grid, _ = ge.curve_table()
        _TABLES[key] = _Tables(
            size=t.size, stride=t.stride, nb=b_grid.numel(),
            curves=t.curves.to(torch.float32).to(device),
            cell_base=t.cell_base.to(device),
            lo=ge._brackets()[0].to(device),
            b_grid=b_grid.to(torch.float32).to(device),
        )  # fmt: skip
    return _TABLES[key]


def _dummies(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a uint8 1: every row valid, a float32 -inf: no sink), read with stride 0."""
    if device not in _DUMMIES:
        _DUMMIES[device] = (
            torch.ones(1, dtype=torch.uint8, device=device),
            torch.full((1,), float("-inf"), dtype=torch.float32, device=device),
        )
    return _DUMMIES[device]


# -- host API -------------------------------------------------------------------------------------


def _mode_ok(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


def kernel_supported(
    query: torch.Tensor, key: torch.Tensor, *, position_bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether ``kernel_site_sums`` takes these inputs (a host-only check of metadata): CUDA
    tensors (or CPU ones under the interpreter), q and k of one dtype among float16, bfloat16
    and float32, 4-D with query heads a multiple of key heads, head dim <= 256 (<= 64 for
    float32) and a multiple of 16 bytes, no position bias, statistics not requested in float64."""
    if position_bias is not None or dtype == torch.float64:
        return False
    if query.dim() != 4 or key.dim() != 4 or query.dtype != key.dtype or query.dtype not in _DTYPES:
        return False
    if query.device != key.device or not _mode_ok(query.device):
        return False
    b, h, _, d = query.shape
    hkv = key.shape[1]
    return (key.shape[0] == b and key.shape[3] == d and 0 < d <= _MAX_HEAD_DIM and hkv > 0
            and h % hkv == 0 and _config_key(query.dtype, d) in _CONFIGS
            and d * query.element_size() % 16 == 0)  # fmt: skip


def _row_strides(x: torch.Tensor, b: int, tq: int, what: str, dtype: torch.dtype) -> tuple[int, int]:
    if x.dtype != dtype or x.dim() != 2 or x.shape[0] not in (1, b) or x.shape[1] != tq:
        raise TritonKernelError(
            f"{what} must be {str(dtype).replace('torch.', '')} of shape (B|1, Tq) = "
            f"({b}|1, {tq}), got {str(x.dtype).replace('torch.', '')} {tuple(x.shape)}"
        )
    return (x.stride(0) if x.shape[0] == b and b > 1 else 0), x.stride(1)


def _check(query, key, start, end, row_valid, sinks):
    if query.dim() != 4 or key.dim() != 4:
        raise TritonKernelError("query and key must be (B, H, T, D) tensors")
    b, h, tq, d = query.shape
    hkv = key.shape[1]
    if key.shape[0] != b or key.shape[3] != d or hkv == 0 or h % hkv != 0:
        raise TritonKernelError(
            f"key {tuple(key.shape)} does not match query {tuple(query.shape)} "
            "(same batch and head dim, query heads a multiple of key heads)"
        )
    if query.dtype != key.dtype or query.dtype not in _DTYPES:
        raise TritonKernelError(
            f"query and key must share one dtype among float16, bfloat16, float32; got "
            f"{query.dtype} and {key.dtype}"
        )
    if not 0 < d <= _MAX_HEAD_DIM or _config_key(query.dtype, d) not in _CONFIGS:
        top = max(k[1] for k in _CONFIGS if k[0] == query.dtype.itemsize)
        raise TritonKernelError(f"head dim {d} of {query.dtype} q/k is not in 1..{top}")
    if d * query.element_size() % 16:  # a key row must be whole 16-byte units for TMA
        raise TritonKernelError(f"head dim {d} of {query.dtype} q/k is not a multiple of "
                                f"{16 // query.element_size()}")  # fmt: skip
    if not _mode_ok(query.device):
        raise TritonKernelError(
            "the Triton kernel runs on CPU tensors only under Triton's interpreter: start Python "
            "with TRITON_INTERPRET=1 (set before triton is imported), or use backend='torch'"
        )
    if bool(triton.knobs.runtime.interpret) != INTERPRETED:
        raise TritonKernelError(
            "TRITON_INTERPRET changed after triton was imported: set it before the process "
            "first imports triton"
        )
    for name, t in (("key", key), ("start", start), ("end", end), ("row_valid", row_valid),
                    ("sinks", sinks)):  # fmt: skip
        if t is not None and t.device != query.device:
            raise TritonKernelError(f"{name} is on {t.device}, query on {query.device}")
    if row_valid is not None and (row_valid.dtype != torch.bool or tuple(row_valid.shape) != (b, tq)):
        raise TritonKernelError(f"row_valid must be bool (B, Tq) = {(b, tq)}, got "
                                f"{row_valid.dtype} {tuple(row_valid.shape)}")  # fmt: skip
    if sinks is not None:
        ok = (sinks.dim() == 1 and sinks.shape[0] == h) or (
            sinks.dim() == 4 and sinks.shape[0] in (1, b) and tuple(sinks.shape[1:]) == (h, tq, 1)
        )
        if not ok:
            raise TritonKernelError(
                f"sinks must be (H,) = ({h},) or (B|1, H, Tq, 1), got {tuple(sinks.shape)}"
            )


@torch.no_grad()
def _row_inputs(row_valid, sinks, b: int, device) -> tuple:
    """(row_valid as uint8, its (B, T) strides, sinks as float32, their (B, H, T) strides), with
    dummies and zero strides where not given."""
    ones, ninf1 = _dummies(device)
    if row_valid is None:
        rv, rvs = ones, (0, 0)
    else:
        rv = row_valid.view(torch.uint8)
        rvs = (rv.stride(0), rv.stride(1))
    if sinks is None:
        return rv, rvs, ninf1, (0, 0, 0)
    sk = sinks.detach().to(torch.float32)
    if sk.dim() == 1:
        return rv, rvs, sk, (0, sk.stride(0), 0)
    return rv, rvs, sk, (sk.stride(0) if sk.shape[0] == b and b > 1 else 0, sk.stride(1), sk.stride(2))


def _key_descriptor(key: torch.Tensor, block_n: int, block_d: int) -> TensorDescriptor:
    """The key tiles' tensor-memory descriptor: (B, Hkv, Tk, D) in (1, 1, block_n, block_d)
    boxes, read past the ends as zeros. A copy is made contiguous first when its head dim is
    strided or a stride or its address is not a multiple of 16 bytes (what TMA needs)."""
    size = key.element_size()
    if key.stride(3) != 1 or key.data_ptr() % 16 or any(st * size % 16 for st in key.stride()[:3]):
        key = key.contiguous()  # (a head dim of no whole 16 bytes was refused by _check)
    return TensorDescriptor(key, list(key.shape), list(key.stride()), [1, 1, block_n, block_d])


def kernel_site_sums(
    query: torch.Tensor, key: torch.Tensor, *, scaling: float, start: torch.Tensor,
    end: torch.Tensor, row_valid: torch.Tensor | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> SiteSums:
    """Every attention statistic of one layer's heads, from one kernel launch.

    Args:
        query: (B, H, Tq, D); key: (B, Hkv, Tk, D), the same dtype (float16, bfloat16 or
            float32), H a multiple of Hkv (query head h reads key head h // (H // Hkv)).
        scaling: the logits are ``scaling * q.k`` (then softcapped).
        start, end: int32 (B|1, Tq): query row t of sequence b sees keys start..end - 1
            (clamped to 0..Tk); its first visible key is ``start``. Rows with no key are dropped.
        row_valid: bool (B, Tq): rows to count (False: dropped), or None (all).
        softcap: Gemma-2 softcapping, z = softcap tanh(scaling q.k / softcap).
        sinks: a learned sink logit per head (H,) (or per query, (B|1, H, Tq, 1)): one more
            option of each row's softmax, as ``rows.finish`` treats it.

    Returns:
        ``SiteSums`` on query's device (float64): names ``rows.attn_metric_names(sinks given)``,
        sums and counts (H, M), maxima (H,) the largest logit (-inf for a head with no row),
        hist (H, 2, vocab.HIST_BINS) the rows' entropy and max_prob bins.
    """
    _check(query, key, start, end, row_valid, sinks)
    b, h, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    device = query.device
    names = attn_metric_names(sinks is not None)
    n_names = len(names)
    bins = vocab.HIST_BINS
    hist = torch.zeros(h, 2, bins, dtype=torch.int32, device=device)
    if b == 0 or tq == 0 or tk == 0 or h == 0:  # nothing to count
        zeros = torch.zeros(h, n_names, dtype=torch.float64, device=device)
        return SiteSums(names, zeros, zeros.clone(), torch.full((h,), float("-inf"), dtype=torch.float64,
                                                                device=device), hist.to(torch.float64))

    ss = _row_strides(start, b, tq, "start", torch.int32)
    es = _row_strides(end, b, tq, "end", torch.int32)
    rv, rvs, sk, sks = _row_inputs(row_valid, sinks, b, device)
    tab = _tables(tk + 1, device)  # n + 1 options with a sink
    consts, options = compile_options(query.dtype, d)
    consts["SOFTCAP"] = softcap is not None
    n_mb = triton.cdiv(tq, consts["BLOCK_M"])
    out = torch.empty(b * h * n_mb, RECORD, dtype=torch.float32, device=device)
    lo_e, hi_e = vocab.HIST_RANGE[vocab.ENTROPY]
    lo_p, hi_p = vocab.HIST_RANGE[vocab.MAX_PROB]

    k_desc = _key_descriptor(key, consts["BLOCK_N"], consts["BLOCK_D"])
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        site_kernel[(b * h, n_mb)](
            query, key, k_desc, start, end, rv, sk, out, hist,
            tab.curves, tab.cell_base, tab.lo, tab.b_grid,
            h, h // hkv, tq, tk, d,
            *query.stride(), *key.stride(), *ss, *es, *rvs, *sks,
            float(scaling), float(softcap) if softcap is not None else 1.0,
            int(sinks is not None),
            float(lo_e), bins / (hi_e - lo_e), float(lo_p), bins / (hi_p - lo_p),
            tab.size, tab.stride, tab.nb,
            **consts, **options,
        )  # fmt: skip
    return _site_sums(out.view(b, h, n_mb, RECORD), hist, names)


def _site_sums(part: torch.Tensor, hist: torch.Tensor, names: tuple[str, ...]) -> SiteSums:
    """The heads' ``SiteSums`` from the kernel's per-program records (B, H, blocks, RECORD)."""
    n_names = len(names)
    tot = part[..., :MAX_COL].to(torch.float64).sum(dim=(0, 2))  # (H, 2 N_VALUES)
    return SiteSums(names, tot[:, :n_names].contiguous(), tot[:, N_VALUES : N_VALUES + n_names].contiguous(),
                    part[..., MAX_COL].amax(dim=(0, 2)).to(torch.float64),  # (H,)
                    hist.to(torch.float64))
