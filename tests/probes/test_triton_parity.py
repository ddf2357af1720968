"""Parity of the Triton kernel (``peakprobe.probes.triton_kernel.kernel_site_sums``) with an
independent float64 reference.

Marker ``triton``; skipped when triton is not installed. By default everything runs on CPU
under Triton's interpreter: importing this module sets ``TRITON_INTERPRET=1`` (at collection,
before anything imports triton; it stays set for the session). ``PEAKPROBE_TRITON_DEVICE=cuda``
runs the same checks compiled on a GPU, plus larger shapes the interpreter is too slow for and
a check that a call makes no host synchronisation.

The reference (``reference``) builds the dense float64 logits from the same q/k (bf16 inputs
upcast exactly), the dense mask of each row's key range, and every statistic row by row with
plain torch float64 reductions (``gaussian_entropy.beta_eff``'s general path for beta_eff, not
the per-n tables the kernel reads). Small blocks (32 query rows, 16 keys; 16 x 16 and
others in one test) make every recurrence cross tiles.

Tolerances (relative, per-head means; counts exact), per q/k dtype: float32, bfloat16 and
float16 alike ``REL = 2e-5`` (half-precision values are exact in float32: the error is the
kernel's float32 accumulation and epilogue; measured under the interpreter: at most 3e-7),
``BETA_REL = 2e-4`` for beta_eff (its inversion amplifies the entropy's rounding for
near-uniform rows; measured: 9e-7); the 0/1 flags exactly; the largest logit to ``REL``, and
exactly where q.k and the scaling are exact in float32; histogram quantiles within one bin of
the exact (inverted-CDF) quantiles of the reference rows, and the bins themselves equal but for
rows within 1e-4 of a bin edge. Compiled on a GPU: float32 q/k ``TF32X3_REL = 1e-4`` (three-pass
TF32 products), the flags within 2 rows per head (approximate exp2, log and division).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.extras import missing

DEVICE = os.environ.get("PEAKPROBE_TRITON_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
if not ON_GPU and "triton" not in sys.modules:
    # Must precede the first import of triton in this process (the interpreter replaces the
    # language's jitted functions at import; importing transformers' modeling code imports
    # triton through torch._dynamo). It stays set for the rest of the session.
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip(
    "triton", reason=missing("triton", "triton is not installed (pip install triton)"), exc_type=ImportError
)

from helpers import ARCHS, tiny_config  # noqa: E402

from peakprobe import vocab  # noqa: E402
from peakprobe.probes import triton_kernel as tk  # noqa: E402
from peakprobe.probes.accumulate import hist_index, histogram_quantile  # noqa: E402
from peakprobe.probes.gaussian_entropy import beta_eff  # noqa: E402
from peakprobe.probes.rows import attn_metric_names  # noqa: E402

pytestmark = pytest.mark.triton

if ON_GPU and not torch.cuda.is_available():
    pytest.skip("PEAKPROBE_TRITON_DEVICE=cuda but no CUDA device", allow_module_level=True)
#: The kernel can run in this process: on the GPU, or on CPU with triton interpreted. When an
#: earlier test module imported triton without the interpreter (a full-suite run), one test
#: runs this file again in a fresh process instead, and the others skip here.
RUN_HERE = ON_GPU or tk.INTERPRETED
SUBPROCESS_TEST = "test_this_file_in_an_interpreter_subprocess"

if not RUN_HERE:

    def test_this_file_in_an_interpreter_subprocess():
        """Triton was imported without TRITON_INTERPRET=1 before this module: run the file in
        a new process with it set, and pass only if every test there passes."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q"]
        out = subprocess.run(
            cmd + ["-p", "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
        assert " passed" in out.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def _only_where_the_kernel_runs(request):
    if not RUN_HERE and request.node.name != SUBPROCESS_TEST:
        pytest.skip(f"triton was imported without the interpreter here: {SUBPROCESS_TEST} runs it")


REL = 2e-5
BETA_REL = 2e-4
#: compiled float32 q/k multiply as three-pass TF32 (about 2^-21 relative per product)
TF32X3_REL = 1e-4
FLAGS = ("peaked", "peaked_entropy", "peaked_xsink", "peaked_entropy_xsink")


@pytest.fixture(autouse=True)
def small_blocks(request):
    """32 query rows x 16 keys per program tile (several tiles at small T) unless the test sets
    its own; the GPU run keeps the default launches."""
    if not ON_GPU:
        tk.set_launch_config(tk.LaunchConfig(32, 16, 4, 1))
    yield
    tk.set_launch_config(None)


# -- the float64 reference ---------------------------------------------------------------------


def reference(q, k, *, scaling, start, end, row_valid=None, softcap=None, sinks=None) -> dict:
    """Every statistic of every row from dense float64 logits. Returns {name: (sums (H,),
    counts (H,))}, "logit_max" (H,) and "rows": {entropy, max_prob} -> list per head of the
    kept rows' values."""
    f64 = torch.float64
    b, h, tq, _ = q.shape
    hkv, tkeys = k.shape[1], k.shape[2]
    kk = k.to(f64).cpu().repeat_interleave(h // hkv, dim=1)  # (B, H, Tk, D)
    z = scaling * (q.to(f64).cpu() @ kk.transpose(-1, -2))  # (B, H, Tq, Tk)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    st = start.long().cpu().expand(b, tq).clamp(min=0)
    en = end.long().cpu().expand(b, tq).clamp(max=tkeys)
    kpos = torch.arange(tkeys)
    valid = ((kpos >= st[..., None]) & (kpos < en[..., None]))[:, None]  # (B, 1, Tq, Tk)
    first = valid & (kpos == st[..., None])[:, None]
    rest = valid & ~first
    rv = torch.ones(b, tq, dtype=torch.bool) if row_valid is None else row_valid.cpu()
    n = valid.sum(-1).to(f64).expand(b, h, tq)
    nr = rest.sum(-1).to(f64).expand(b, h, tq)
    kept = (n > 0) & rv[:, None]  # (B, H, Tq)
    sink = None
    if sinks is not None:
        s = sinks.to(f64).cpu()
        sink = (s.view(1, h, 1) if s.dim() == 1 else s[..., 0]).expand(b, h, tq)

    def softmax_stats(mask, extra):
        zm = z.masked_fill(~mask, -math.inf)
        zz = zm if extra is None else torch.cat([zm, extra[..., None]], -1)
        lse = torch.logsumexp(zz, -1)
        lp = zz - lse[..., None]
        p = lp.exp()
        ent = -torch.where(p > 0, p * lp, torch.zeros(())).sum(-1)
        return ent, p.amax(-1), lse, zm

    def logit_stats(mask, cnt):
        mean = z.masked_fill(~mask, 0.0).sum(-1) / cnt.clamp(min=1)
        var = ((z - mean[..., None]) ** 2).masked_fill(~mask, 0.0).sum(-1) / cnt.clamp(min=1)
        return var.sqrt(), mean

    def thr(x):
        return (2 * x.clamp(min=1).log()).sqrt()

    ent, max_prob, lse, zm = softmax_stats(valid, sink)
    std, mean = logit_stats(valid, n)
    top = zm.topk(min(2, tkeys), -1).values
    row_max = top[..., 0]
    second = top[..., 1] if tkeys > 1 else row_max
    n_opt = n + (sink is not None)
    b_eff = beta_eff(ent.nan_to_num(0.0), n_opt)
    z_first = z.masked_fill(~first, -math.inf).amax(-1)
    ent_x, max_prob_x, _, _ = softmax_stats(rest, None)
    std_x, _ = logit_stats(rest, nr)
    b_eff_x = beta_eff(ent_x.nan_to_num(0.0), nr)
    two_opt, two_keys, x_ok = kept & (n_opt >= 2), kept & (n >= 2), kept & (nr >= 2)
    values = {
        "entropy": (ent, kept),
        "entropy_norm": (ent / n_opt.clamp(min=2).log(), two_opt),
        "max_prob": (max_prob, kept),
        "logit_std": (std, kept),
        "logit_max_minus_mean": (row_max - mean, kept),
        "logit_top_gap": (row_max - second, two_keys),
        "peaked": ((std > thr(n)).to(f64), kept),
        "first_key_prob": ((z_first - lse).exp(), kept),
        "beta_eff": (b_eff, two_opt),
        "peaked_entropy": ((b_eff > thr(n_opt)).to(f64), two_opt),
        "entropy_xsink": (ent_x, x_ok),
        "max_prob_xsink": (max_prob_x, x_ok),
        "logit_std_xsink": (std_x, x_ok),
        "peaked_xsink": ((std_x > thr(nr)).to(f64), x_ok),
        "beta_eff_xsink": (b_eff_x, x_ok),
        "peaked_entropy_xsink": ((b_eff_x > thr(nr)).to(f64), x_ok),
        vocab.LOGIT_ROW_MAX: (row_max, kept),
    }
    if sink is not None:
        values[vocab.SINK_PROB] = ((sink - lse).exp(), kept)
    out = {
        name: (torch.where(w, v, torch.zeros(())).sum((0, 2)), w.to(f64).sum((0, 2)))
        for name, (v, w) in values.items()
    }
    out["logit_max"] = torch.where(kept, row_max, -math.inf).amax((0, 2))
    out["rows"] = {
        name: [values[name][0][:, i][kept[:, i]] for i in range(h)] for name in vocab.QUANTILE_OF
    }
    return out


def assert_parity(got, ref, *, exact_max: bool = False, rel: float = REL, flag_rows: int = 0):
    """Kernel ``SiteSums`` vs the reference: names, counts, means (``rel``; beta_eff
    ``BETA_REL``; the 0/1 flags up to ``flag_rows`` rows per head), maxima, histograms."""
    assert got.names == tuple(n for n in ref if n not in ("logit_max", "rows"))
    h = got.sums.shape[0]
    for i, name in enumerate(got.names):
        sums, counts = ref[name]
        assert torch.equal(got.counts[:, i].cpu(), counts), name
        g = got.sums[:, i].cpu() / counts.clamp(min=1)
        r = sums / counts.clamp(min=1)
        if name in FLAGS:
            assert ((got.sums[:, i].cpu() - sums).abs() <= flag_rows).all(), (name, g, r)
        else:
            tol = max(BETA_REL, rel) if name.startswith("beta_eff") else rel
            torch.testing.assert_close(g, r, rtol=tol, atol=1e-12, msg=name)
    if exact_max:
        assert torch.equal(got.maxima.cpu(), ref["logit_max"]), (got.maxima, ref["logit_max"])
    else:
        torch.testing.assert_close(got.maxima.cpu(), ref["logit_max"], rtol=rel, atol=0.0)
    hist = got.hist.cpu().numpy()
    assert got.hist.shape == (h, len(vocab.QUANTILE_OF), vocab.HIST_BINS)
    for j, name in enumerate(vocab.QUANTILE_OF):
        lo, hi = vocab.HIST_RANGE[name]
        width = (hi - lo) / vocab.HIST_BINS
        for head in range(h):
            rows = ref["rows"][name][head]
            assert hist[head, j].sum() == rows.numel(), (name, head)
            exact = np.bincount(hist_index(rows, name).numpy(), minlength=vocab.HIST_BINS)
            # a row may change bins only where its value sits on a bin edge
            scaled = (rows - lo) / width
            edge = int(((scaled - scaled.round()).abs() < 1e-4).sum())
            assert np.abs(np.cumsum(hist[head, j]) - np.cumsum(exact)).max() <= edge, (name, head)
            for qq in vocab.QUANTILES:
                if rows.numel() == 0:
                    continue
                want = float(np.quantile(rows.numpy(), qq, method="inverted_cdf"))
                assert abs(histogram_quantile(hist[head, j], qq, name) - want) <= width + 1e-9


# -- inputs -------------------------------------------------------------------------------------


def _qk(b=2, h=4, hkv=2, tq=37, tk_=None, d=8, dtype=torch.float32, seed=0, amp=2.0):
    """Random q, k with a different amplitude per head (near-uniform to peaked rows)."""
    tk_ = tq if tk_ is None else tk_
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 1.0, h).view(1, h, 1, 1) * amp
    q = torch.randn(b, h, tq, d, generator=g) * scale
    k = torch.randn(b, hkv, tk_, d, generator=g) * amp
    return q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE)


def _i32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32).to(DEVICE)


def ranges(kind: str, b: int, t: int, window: int = 5):
    """(start, end, row_valid) of one batch kind over T query rows = T keys."""
    pos = torch.arange(t)
    causal_end = (pos + 1).view(1, t)
    zero = torch.zeros(1, t, dtype=torch.long)
    rv = None
    if kind == "causal":
        start, end = zero, causal_end
    elif kind == "window":
        start, end = (pos - window + 1).clamp(min=0).view(1, t), causal_end
    elif kind == "left_pad":  # sequence i starts at pads[i]; padding rows are not counted
        pads = torch.tensor([0, t // 3, t - 2, t // 2][:b]).view(b, 1)
        start, end = pads.expand(b, t), causal_end.expand(b, t)
        rv = pos.view(1, t) >= pads
    elif kind == "left_pad_window":
        pads = torch.tensor([0, t // 3, t - 2, t // 2][:b]).view(b, 1)
        start = torch.maximum(pads, (pos - window + 1).view(1, t))
        end = causal_end.expand(b, t)
        rv = pos.view(1, t) >= pads
    elif kind == "right_pad":  # sequence i has lens[i] real tokens
        lens = torch.tensor([t, t - t // 3, 3, t // 2][:b]).view(b, 1)
        start, end = zero.expand(b, t), torch.minimum(causal_end, lens)
        rv = pos.view(1, t) < lens
    elif kind == "packed":  # three documents per sequence, each row sees its own document
        starts = []
        for i in range(b):
            cut = sorted({t // 4 + i, t // 2 + 2 * i})
            doc = torch.tensor([0] + cut)
            starts.append(doc[torch.searchsorted(doc, pos, right=True) - 1])
        start, end = torch.stack(starts), causal_end.expand(b, t)
    else:
        raise KeyError(kind)
    return _i32(start), _i32(end), None if rv is None else rv.to(DEVICE)


def _sinks(h: int) -> torch.Tensor:
    """Sinks that take real probability, some heads more (as test_hooks_exact's gpt-oss)."""
    return torch.linspace(-2.0, 6.0, h).to(DEVICE)


def _check(q, k, *, exact_max=False, **kw):
    got = tk.kernel_site_sums(q, k, **kw)
    ref = reference(q, k, **kw)
    assert_parity(got, ref, exact_max=exact_max)
    return got, ref


# -- the hooks' architectures -------------------------------------------------------------------


def _gpt_oss_features() -> dict:
    """tests/hooks/test_hooks_exact.py's tiny gpt-oss: GQA 4/2, head dim 8, sliding window 5 on
    alternate layers, a learned sink per head."""
    return dict(h=4, hkv=2, d=8, scaling=8**-0.5, softcap=None, window=5, sinks=True)


def arch_features(arch: str) -> dict:
    """The attention shape and features of helpers' tiny ``arch``: heads, key heads, head dim,
    scaling, softcapping, sliding window, learned sinks."""
    if arch == "gpt_oss":
        return _gpt_oss_features()
    cfg = tiny_config(arch)
    h = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    d = getattr(cfg, "head_dim", None) or hidden // h
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return dict(
        h=h, hkv=getattr(cfg, "num_key_value_heads", None) or h, d=d,
        scaling=(scalar if scalar is not None else d) ** -0.5,
        softcap=getattr(cfg, "attn_logit_softcapping", None),
        window=getattr(cfg, "sliding_window", None), sinks=False,
    )  # fmt: skip


ALL_ARCHS = ARCHS + ["gpt_oss"]
KINDS = ("causal", "left_pad", "right_pad", "window", "packed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_architectures_match_float64_reference(arch, dtype):
    """Each architecture's attention (GQA ratio, head dim, scaling, softcapping, sinks) on every
    batch kind: causal, left- and right-padded, sliding window (the model's own, else 7) and
    three packed documents per sequence; 2 sequences of 37 tokens."""
    f = arch_features(arch)
    assert arch != "gemma2_softcap" or f["softcap"] == 2.0  # the features are really read
    assert arch not in ("llama_gqa", "gpt_oss") or f["hkv"] < f["h"]
    q, k = _qk(b=2, h=f["h"], hkv=f["hkv"], tq=37, d=f["d"], dtype=dtype, seed=len(arch),
               amp=4.0 if f["softcap"] else 2.0)  # fmt: skip
    sinks = _sinks(f["h"]) if f["sinks"] else None
    for kind in KINDS:
        start, end, rv = ranges(kind, 2, 37, window=f["window"] or 7)
        _check(q, k, scaling=f["scaling"], start=start, end=end, row_valid=rv,
               softcap=f["softcap"], sinks=sinks)  # fmt: skip


# -- features one at a time ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])  # fmt: skip
@pytest.mark.parametrize("kind", KINDS + ("left_pad_window",))
def test_batch_kinds_gqa_head_dim_64(kind, dtype):
    """GQA 4/1, head dim 64 (no head-dim mask), every batch kind, in each input dtype."""
    q, k = _qk(b=3, h=4, hkv=1, tq=40, d=64, dtype=dtype, amp=0.7)
    start, end, rv = ranges(kind, 3, 40, window=9)
    _check(q, k, scaling=64**-0.5, start=start, end=end, row_valid=rv)


@pytest.mark.parametrize("kind", ("causal", "left_pad", "packed"))
def test_sinks_and_softcap(kind):
    """A learned sink per head with softcapping (Gemma-2 style cap on gpt-oss style sinks)."""
    q, k = _qk(b=2, h=4, hkv=2, tq=33, d=16, amp=3.0)
    start, end, rv = ranges(kind, 2, 33)
    _check(q, k, scaling=0.25, start=start, end=end, row_valid=rv, softcap=10.0,
           sinks=_sinks(4))  # fmt: skip


def test_per_query_sinks():
    """Sinks given per query (B, H, Tq, 1), as inkling2 passes them."""
    q, k = _qk(b=2, h=4, hkv=4, tq=21, d=16)
    g = torch.Generator().manual_seed(3)
    sinks = (torch.randn(2, 4, 21, 1, generator=g) * 3).to(DEVICE)
    start, end, rv = ranges("left_pad", 2, 21)
    _check(q, k, scaling=0.3, start=start, end=end, row_valid=rv, sinks=sinks)


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 64), (64, 32), (128, 64)])
def test_block_sizes_and_fast_tiles(blocks):
    """Different tiles: fast (unmasked) tiles exist for the later query blocks of a causal
    batch of 100 rows at 16 x 16, none at 128 x 64; all give the same statistics."""
    tk.set_launch_config(tk.LaunchConfig(*blocks, 4, 1))
    q, k = _qk(b=1, h=2, hkv=1, tq=100, d=16, seed=4)
    for kind in ("causal", "window"):
        start, end, rv = ranges(kind, 1, 100, window=40)
        _check(q, k, scaling=0.35, start=start, end=end, row_valid=rv)


def test_query_offset_empty_and_clamped_ranges():
    """Tq < Tk (12 queries after 30 cached keys), ranges past Tk or below 0 (clamped), rows with
    an empty range (dropped), rows with one or two keys (no top gap / no _xsink), row_valid."""
    q, k = _qk(b=2, h=2, hkv=1, tq=12, tk_=42, d=16, seed=5)
    pos = torch.arange(12) + 30
    start = torch.stack([torch.zeros(12, dtype=torch.long), (pos - 4).clamp(min=0)])
    end = torch.stack([pos + 1, pos + 1])
    start[0, 0], end[0, 0] = -5, 50  # clamped to [0, 42)
    start[0, 1], end[0, 1] = 10, 10  # empty
    start[0, 2], end[0, 2] = 7, 3  # empty
    start[1, 3], end[1, 3] = 20, 21  # one key
    start[1, 4], end[1, 4] = 20, 22  # two keys
    rv = torch.ones(2, 12, dtype=torch.bool)
    rv[1, 5] = False
    got, ref = _check(q, k, scaling=0.3, start=_i32(start), end=_i32(end), row_valid=rv.to(DEVICE))
    col = got.names.index("entropy")
    assert got.counts[:, col].tolist() == [21.0, 21.0]  # 24 rows - 2 empty - 1 not valid


def test_largest_logit_is_exact():
    """Integer q, k and a power-of-two scaling: every logit is exact in float32, so the largest
    logit of each head equals the float64 reference bit for bit, and so do the row maxima."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-4, 5, (2, 3, 29, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-4, 5, (2, 3, 29, 16), generator=g).float().to(DEVICE)
    start, end, rv = ranges("left_pad", 2, 29)
    got, ref = _check(q, k, scaling=0.125, start=start, end=end, row_valid=rv, exact_max=True)
    col = got.names.index(vocab.LOGIT_ROW_MAX)
    assert torch.equal(got.sums[:, col].cpu(), ref[vocab.LOGIT_ROW_MAX][0])


def test_std_stays_accurate_when_mean_dominates():
    """Logits (20000 + small integer) / 64: |mean| ~ 312 >> std ~ 0.05, all exact in float32.
    A one-pass float32 E[z^2] - E[z]^2 loses the std entirely; the kernel (sums relative to the
    first key's logit, merged tile by tile) matches the float64 reference."""
    t = 90
    g = torch.Generator().manual_seed(5)
    q = torch.zeros(1, 1, t, 16)
    q[..., 0] = 1.0
    q[..., 1] = torch.randint(1, 4, (t,), generator=g).float()
    k = torch.zeros(1, 1, t, 16)
    k[..., 0] = 20000.0
    k[..., 1] = torch.randint(-3, 4, (t,), generator=g).float()
    full = _i32(torch.full((1, t), t))
    _check(q.to(DEVICE), k.to(DEVICE), scaling=1 / 64, start=_i32(torch.zeros(1, t)), end=full,
           exact_max=True)  # fmt: skip
    z = ((q[0, 0] @ k[0, 0].T) / 64).numpy().astype(np.float32)  # (T, T), exact
    naive = np.sqrt(np.maximum((z * z).mean(1, dtype=np.float32) - z.mean(1) ** 2, 0))
    true = z.astype(np.float64).std(1)
    assert np.abs(naive - true).max() > 1e-3 * true.max()  # the case is hard for float32


def test_identical_keys_give_uniform_rows_closed_form():
    """All keys equal: every causal row is uniform over its n = i + 1 keys (a tie everywhere:
    top gap 0, the sink-excluded max_prob 1 / (n - 1))."""
    t = 45
    q, _ = _qk(b=1, h=2, hkv=1, tq=t)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, t, 8).contiguous().to(DEVICE)
    start, end, _ = ranges("causal", 1, t)
    got = tk.kernel_site_sums(q, k, scaling=0.5, start=start, end=end)
    n = np.arange(1, t + 1, dtype=np.float64)
    means = (got.sums / got.counts).cpu().numpy()
    col = {name: i for i, name in enumerate(got.names)}
    np.testing.assert_allclose(means[:, col["entropy"]], np.log(n).mean(), rtol=1e-5)
    np.testing.assert_allclose(means[:, col["max_prob"]], (1 / n).mean(), rtol=1e-5)
    np.testing.assert_allclose(means[:, col["max_prob_xsink"]], (1 / (n[2:] - 1)).mean(), rtol=1e-5)
    np.testing.assert_allclose(means[:, col["entropy_norm"]], 1.0, rtol=1e-5)
    for name in ("logit_std", "logit_top_gap", "logit_max_minus_mean", "peaked"):
        assert np.abs(means[:, col[name]]).max() < 1e-4, name


def test_key_views_as_models_give_them():
    """Key tiles come through a TMA descriptor of the key's own strides: a (B, T, H, D) tensor
    seen as (B, H, T, D) and one cut from a fused projection read in place; a strided head dim
    and strides that are not whole 16-byte units are copied first. All match the reference."""
    q, k = _qk(b=2, h=4, hkv=2, tq=30, d=16, seed=6)
    start, end, rv = ranges("left_pad", 2, 30)
    kw = dict(scaling=0.3, start=start, end=end, row_valid=rv)
    want = tk.kernel_site_sums(q, k, **kw)
    fused = torch.cat([k, 2 * k, k], dim=-1).transpose(1, 2).contiguous()  # (B, T, H, 3D)
    views = {
        "transposed": k.transpose(1, 2).contiguous().transpose(1, 2),
        "fused": fused[..., 16:32].transpose(1, 2) / 2,  # a slice of the qkv projection
        "fused_in_place": fused[..., 32:48].transpose(1, 2),
        "strided_head_dim": torch.stack([k, k], dim=-1)[..., 0],
        "odd_strides": torch.cat([k, k[..., :2]], dim=-1)[..., :16],  # rows of 72 bytes
    }
    assert views["fused_in_place"].stride(3) == 1 and views["strided_head_dim"].stride(3) == 2
    assert views["odd_strides"].stride(2) * 4 % 16 != 0
    for name, view in views.items():
        got = tk.kernel_site_sums(q, view, **kw)
        assert torch.equal(got.sums, want.sums), name
        assert torch.equal(got.maxima, want.maxima), name
    _check(q, views["fused_in_place"], **kw)


# -- the host side -----------------------------------------------------------------------------


def test_no_host_reads_of_tensor_values(monkeypatch):
    """The host code never reads a tensor's values (on a GPU each read is a synchronisation):
    every way torch offers to do so raises during a call (the interpreter's launch converts its
    arguments through numpy, which is left alone)."""
    q, k = _qk(b=2, h=4, hkv=2, tq=20, d=16)
    start, end, rv = ranges("left_pad", 2, 20)
    tk.kernel_site_sums(q, k, scaling=0.3, start=start, end=end, row_valid=rv)  # warm caches

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    tk.kernel_site_sums(q, k, scaling=0.3, start=start, end=end, row_valid=rv, sinks=_sinks(4))


def test_kernel_supported_and_one_line_errors():
    q, k = _qk(b=1, h=4, hkv=2, tq=8, d=16)
    start, end, _ = ranges("causal", 1, 8)
    assert tk.kernel_supported(q, k)
    assert not tk.kernel_supported(q, k, position_bias=torch.zeros(1, 4, 8, 8))
    assert not tk.kernel_supported(q, k, dtype=torch.float64)
    assert not tk.kernel_supported(q.double(), k.double())
    assert not tk.kernel_supported(q, k.to(torch.bfloat16))
    assert not tk.kernel_supported(q, k[:, :1].expand(1, 3, 8, 16))
    wide = torch.zeros(1, 4, 8, 256, device=DEVICE)
    assert tk.kernel_supported(wide.to(torch.bfloat16), wide.to(torch.bfloat16)[:, :2])
    assert not tk.kernel_supported(wide, wide[:, :2])  # float32 above head dim 64
    assert not tk.kernel_supported(wide[..., :128], wide[:, :2, :, :128])
    assert tk.kernel_supported(wide[..., :64], wide[:, :2, :, :64])
    odd = wide[..., :20].to(torch.bfloat16)  # 40 bytes a key row: not whole 16-byte TMA units
    assert not tk.kernel_supported(odd, odd[:, :2])
    assert tk.kernel_supported(wide[..., :20], wide[:, :2, :, :20])  # float32: 80 bytes
    kw = dict(scaling=1.0, start=start, end=end)
    cases = [
        (dict(query=q, key=k[:, :1].expand(1, 3, 8, 16)), "multiple of key heads"),
        (dict(query=q, key=k.to(torch.bfloat16)), "one dtype"),
        (dict(query=q, key=k, start=start.long()), "start must be int32"),
        (dict(query=q, key=k, end=end[:, :5]), r"end must be int32 of shape \(B\|1, Tq\)"),
        (dict(query=q, key=k, row_valid=torch.ones(1, 8, dtype=torch.int32, device=DEVICE)),
         "row_valid must be bool"),
        (dict(query=q, key=k, sinks=torch.zeros(3, device=DEVICE)), "sinks must be"),
        (dict(query=wide, key=wide), "head dim 256"),
        (dict(query=odd, key=odd[:, :2]), "head dim 20 of torch.bfloat16 q/k is not a multiple of 8"),
    ]  # fmt: skip
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            tk.kernel_site_sums(**{**kw, **args})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="power of two"):
        tk.set_launch_config(tk.LaunchConfig(24, 16, 4, 1))


def test_empty_inputs_give_empty_sums():
    q, k = _qk(b=1, h=3, hkv=3, tq=5, tk_=5, d=16)
    start, end, _ = ranges("causal", 1, 5)
    got = tk.kernel_site_sums(q, k[:, :, :0], scaling=1.0, start=start, end=end, sinks=_sinks(3))
    assert got.names == attn_metric_names(True)
    assert got.sums.shape == got.counts.shape == (3, len(got.names))
    assert float(got.counts.abs().sum()) == 0.0 and torch.isinf(got.maxima).all()
    assert got.hist.shape == (3, 2, vocab.HIST_BINS) and float(got.hist.sum()) == 0.0


_NO_INTERPRETER = r"""
import torch
from peakprobe.probes import triton_kernel as tk
q = torch.randn(1, 2, 5, 16)
t = torch.arange(5, dtype=torch.int32).view(1, 5)
assert not tk.kernel_supported(q, q)
try:
    tk.kernel_site_sums(q, q, scaling=1.0, start=t * 0, end=t + 1)
except ValueError as e:
    print(e)
"""


@pytest.mark.skipif(ON_GPU, reason="a GPU process runs CUDA tensors")
def test_cpu_tensors_without_the_interpreter_are_refused():
    """A process that imported triton without TRITON_INTERPRET gets a one-line ValueError."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _NO_INTERPRETER], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    msg = out.stdout.strip()
    assert "TRITON_INTERPRET=1" in msg and "\n" not in msg


# -- GPU only -----------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="large shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize(("dtype", "d"), [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64),
                                          (torch.float16, 128), (torch.float32, 64)])
def test_pythia_like_shapes_on_gpu(dtype, d):
    """Default launches, T = 1000 (many tiles), causal, left-padded and windowed; no host
    synchronisation inside a call (CUDA sync debug mode raises on one)."""
    q, k = _qk(b=2, h=4, hkv=2, tq=1000, d=d, dtype=dtype, amp=1.5)
    for kind in ("causal", "left_pad", "window"):
        start, end, rv = ranges(kind, 2, 1000, window=300)
        kw = dict(scaling=d**-0.5, start=start, end=end, row_valid=rv)
        tk.kernel_site_sums(q, k, **kw)  # compile, build tables
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = tk.kernel_site_sums(q, k, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # approximate exp2 / log / division on the device: a flag may flip for a row that
        # sits within rounding of its threshold
        rel = TF32X3_REL if dtype == torch.float32 else REL
        assert_parity(got, reference(q, k, **kw), rel=rel, flag_rows=2)
