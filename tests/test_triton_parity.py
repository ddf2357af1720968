"""Parity of the Triton kernel (``peakprobe.probes.triton_kernel``) with the torch path.

Marker ``triton``; skipped when triton is not installed. By default everything runs on CPU
under Triton's interpreter: importing this module sets ``TRITON_INTERPRET=1`` (at collection,
before anything imports triton; it stays set for the session). ``PEAKPROBE_TRITON_DEVICE=cuda``
runs the same checks compiled on a GPU, plus larger shapes the interpreter is too slow for.

References: the torch path (``attention_head_sums``, itself checked against eager attention in
test_hooks_exact.py) in float32 and in float64, and closed forms / brute-force numpy for
constructed logits. Most cases use 16-key blocks so that every recurrence crosses blocks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

DEVICE = os.environ.get("PEAKPROBE_TRITON_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
if not ON_GPU and "triton" not in sys.modules:
    # Must precede the first import of triton in this process (the interpreter replaces the
    # language's jitted functions at import; importing transformers' modeling code imports
    # triton through torch._dynamo). It stays set for the rest of the session.
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip(
    "triton", reason="triton is not installed (pip install triton)", exc_type=ImportError
)

from conftest import ARCHS, left_padded_batch, tiny_model  # noqa: E402

from peakprobe.hooks import ProbeConfig, attach  # noqa: E402
from peakprobe.probes import MaskSpec, attention_head_sums  # noqa: E402
from peakprobe.probes import triton_kernel as tk  # noqa: E402

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
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


FP32_REL = 1e-5
BF16_REL = 1e-3


@pytest.fixture
def block_n(request):
    """Keys per block for one test (default 16: many blocks at small T)."""
    tk.set_launch_config(tk.LaunchConfig(block_n=getattr(request, "param", 16), num_warps=4))
    yield
    tk.set_launch_config(None)


def _means(result):
    """Means and counts of the kernel's metrics (the others come from the torch path)."""
    names, sums, counts = result
    cols = [names.index(name) for name in tk.ATTN_METRICS]
    sums, counts = sums[:, cols].cpu(), counts[:, cols].cpu()
    return sums / counts.clamp(min=1), counts


def _assert_parity(got, ref, rel: float) -> None:
    (g, gc), (r, rc) = _means(got), _means(ref)
    assert torch.equal(gc, rc), (gc, rc)
    torch.testing.assert_close(g, r, rtol=rel, atol=0.0)


def _both(q, k, **kw):
    """(kernel, torch float32, torch float64 on the same inputs) per-head sums."""
    got = tk.attention_head_sums_triton(q, k, **kw)
    ref32 = attention_head_sums(q, k, **kw)
    ref64 = attention_head_sums(q.double(), k.double(), **{**kw, "dtype": torch.float64})
    return got, ref32, ref64


def _qk(b=2, h=4, hkv=2, tq=37, tk_=37, d=8, dtype=torch.float32, seed=0, amp=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, tq, d, generator=g) * amp).to(dtype).to(DEVICE)
    k = (torch.randn(b, hkv, tk_, d, generator=g) * amp).to(dtype).to(DEVICE)
    return q, k


def _left_pad_bool(b, tq, tk_, pads, causal=True):
    """(B, 1, Tq, Tk) bool mask: causal over real keys, left padding, q_offset = Tk - Tq."""
    qpos = torch.arange(tq).view(tq, 1) + (tk_ - tq)
    kpos = torch.arange(tk_).view(1, tk_)
    m = torch.ones(b, 1, tq, tk_, dtype=torch.bool)
    if causal:
        m &= kpos <= qpos
    for i, p in enumerate(pads):
        m[i, :, :, :p] = False
    return m.to(DEVICE)


# -- the hooks' model set, with padding ------------------------------------------------------


def _frames(model, ids, mask, modes, monkeypatch):
    """Per-site attention frames of each (backend, dtype); checks that the triton backend
    really called the kernel once per layer (else the comparison would be torch vs torch)."""
    calls = []
    kernel = tk.attention_head_sums_triton

    def counted(*args, **kwargs):
        calls.append(kwargs["dtype"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tk, "attention_head_sums_triton", counted)  # the hooks import it late
    out = {}
    for backend, dtype in modes:
        calls.clear()
        with attach(model, ProbeConfig(backend=backend, dtype=dtype, chunk=64)) as probe:
            probe.run_batch(ids, mask)
            df = probe.to_frame()
        expected = model.config.num_hidden_layers if backend == "triton" else 0
        assert len(calls) == expected, (backend, len(calls))
        out[(backend, dtype)] = df[df.site_kind == "attn"].reset_index(drop=True)
    return out


def _assert_frames(got, ref, rel):
    assert got[["layer", "head", "metric"]].equals(ref[["layer", "head", "metric"]])
    assert got["n_rows"].tolist() == ref["n_rows"].tolist()
    np.testing.assert_allclose(got["value"], ref["value"], rtol=rel, atol=0.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_models_float32_match_torch_path(arch, block_n, monkeypatch):
    """fp32 tiny models, left-padded 24-token batch (two key blocks; one sequence's first block
    is all padding): kernel == torch path (float32 and float64 statistics of the same q/k) to
    1e-5 relative, every layer and head."""
    ids, mask = left_padded_batch(length=24, pads=(0, 9, 17))
    model = tiny_model(arch, dtype=torch.float32).to(DEVICE)
    f = _frames(
        model,
        ids,
        mask,
        [("triton", "float32"), ("torch", "float32"), ("torch", "float64")],
        monkeypatch,
    )
    _assert_frames(f[("triton", "float32")], f[("torch", "float32")], FP32_REL)
    _assert_frames(f[("triton", "float32")], f[("torch", "float64")], FP32_REL)
    assert f[("triton", "float32")]["value"].abs().sum() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_models_bfloat16_match_torch_path(arch, block_n, monkeypatch):
    """bf16 tiny models (bf16 q/k and masks, fp32 accumulation): kernel == torch path run on
    the same bf16 q/k upcast to float32, to 1e-3 relative."""
    ids, mask = left_padded_batch(length=24, pads=(0, 9, 17))
    model = tiny_model(arch, dtype=torch.bfloat16).to(DEVICE)
    f = _frames(model, ids, mask, [("triton", "float32"), ("torch", "float32")], monkeypatch)
    _assert_frames(f[("triton", "float32")], f[("torch", "float32")], BF16_REL)


# -- direct kernel checks on random q/k -----------------------------------------------------


def _masks(b, h, tq, tk_):
    g = torch.Generator().manual_seed(7)
    pad_bool = _left_pad_bool(b, tq, tk_, pads=(0, 20))
    fully = pad_bool.clone()
    fully[0, :, 5] = False  # one row with no visible key
    rand_bool = (torch.rand(b, h, tq, tk_ + 5, generator=g) > 0.4).to(DEVICE)  # wider than Tk
    values = torch.randn(b, h, tq, tk_, generator=g)
    hide = torch.rand(b, h, tq, tk_, generator=g) < 0.3

    def additive(dtype):
        lowest = torch.finfo(dtype).min
        return torch.where(hide, torch.tensor(lowest, dtype=dtype), values.to(dtype)).to(DEVICE)

    return {
        "causal": MaskSpec(),
        "causal_window": MaskSpec(sliding_window=5),
        "window_1": MaskSpec(sliding_window=1),  # every row has n = 1
        "full": MaskSpec(causal=False),
        "bool_padded": MaskSpec(mask=pad_bool),
        "bool_fully_masked_row": MaskSpec(mask=fully),
        "bool_per_head_wide": MaskSpec(mask=rand_bool),
        "bool_broadcast_batch": MaskSpec(mask=pad_bool[:1]),
        "additive_f32": MaskSpec(mask=additive(torch.float32)),
        "additive_bf16": MaskSpec(mask=additive(torch.bfloat16)),
        "additive_f64": MaskSpec(mask=additive(torch.float64)),
    }


MASK_CASES = [(name, None) for name in _masks(2, 4, 37, 37)] + [
    (name, 10.0) for name in ("causal", "bool_padded", "additive_bf16")
]


@pytest.mark.parametrize("name,softcap", MASK_CASES)
def test_mask_forms_match_torch_path(name, softcap, block_n):
    """Each mask form, GQA (4 query / 2 key heads), T = 37 (not a multiple of any block),
    head dim 8 (padded to 16), with padding rows excluded through row_valid."""
    q, k = _qk()
    spec = _masks(2, 4, 37, 37)[name]
    row_valid = torch.ones(2, 37, dtype=torch.bool)
    row_valid[1, :20] = False
    kw = dict(scaling=8**-0.5, mask=spec, softcap=softcap, row_valid=row_valid.to(DEVICE))
    got, ref32, ref64 = _both(q, k, **kw)
    _assert_parity(got, ref32, FP32_REL)
    _assert_parity(got, ref64, FP32_REL)


@pytest.mark.parametrize("block_n", [16, 64], indirect=True)
@pytest.mark.parametrize("chunk", [5, 64])
def test_query_offset_odd_head_dim_and_block_sizes(chunk, block_n):
    """Tq < Tk (q_offset = 23) with causal and sliding-window structure, head dim 24, MHA."""
    q, _ = _qk(b=2, h=3, hkv=3, tq=14, tk_=37, d=24, seed=3)
    _, k = _qk(b=2, h=3, hkv=3, tq=37, tk_=37, d=24, seed=4)
    for spec in (MaskSpec(q_offset=23), MaskSpec(q_offset=23, sliding_window=9)):
        got, ref32, ref64 = _both(q, k, scaling=0.3, mask=spec, chunk=chunk)
        _assert_parity(got, ref32, FP32_REL)
        _assert_parity(got, ref64, FP32_REL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_match_torch_path_on_upcast(dtype, block_n):
    """bf16 / fp16 q and k (GQA, causal, left-padded bool mask): float32 accumulation matches
    the torch path on the same values upcast to float32, to 1e-3 relative."""
    q, k = _qk(dtype=dtype)
    for spec in (MaskSpec(), MaskSpec(mask=_left_pad_bool(2, 37, 37, pads=(0, 20)))):
        got = tk.attention_head_sums_triton(q, k, scaling=8**-0.5, mask=spec)
        ref = attention_head_sums(q.float(), k.float(), scaling=8**-0.5, mask=spec)
        _assert_parity(got, ref, BF16_REL)


def test_window_of_one_counts_no_two_option_rows(block_n):
    q, k = _qk()
    names, sums, counts = tk.kernel_head_sums(
        q, k, scaling=1.0, mask=MaskSpec(sliding_window=1)
    )
    col = {n: i for i, n in enumerate(names)}
    rows = 2 * 37
    assert counts[:, col["entropy"]].tolist() == [rows] * 4
    assert counts[:, col["entropy_norm"]].tolist() == [0.0] * 4
    assert counts[:, col["logit_top_gap"]].tolist() == [0.0] * 4
    # One option: p = 1 on it, which is also the first key; entropy and std are 0.
    assert sums[:, col["max_prob"]].tolist() == [rows] * 4
    assert sums[:, col["first_key_prob"]].tolist() == [rows] * 4
    assert sums[:, col["entropy"]].abs().max() < 1e-6


def test_identical_keys_give_uniform_rows_closed_form(block_n):
    """All keys equal -> every causal row is uniform over its n = i + 1 keys: entropy log n,
    max_prob = first_key_prob = 1/n, std = top gap = 0, entropy_norm = 1."""
    t = 45
    q, _ = _qk(b=1, h=2, hkv=1, tq=t, tk_=t)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, t, 8).contiguous().to(DEVICE)
    names, sums, counts = tk.kernel_head_sums(q, k, scaling=0.5, mask=MaskSpec())
    n = np.arange(1, t + 1, dtype=np.float64)
    expect = {
        "entropy": np.log(n).sum(),
        "entropy_norm": float(t - 1),
        "max_prob": (1 / n).sum(),
        "first_key_prob": (1 / n).sum(),
        "peaked": 0.0,
    }
    for i, name in enumerate(names):
        if name in expect:
            np.testing.assert_allclose(sums[:, i].cpu(), expect[name], rtol=1e-5)
        else:  # logit_std, logit_max_minus_mean, logit_top_gap
            assert sums[:, i].abs().max() < 1e-4, name


def _ramp_reference(t: int, delta: float) -> dict[str, float]:
    """Brute force in numpy float64: row i sees logits delta * (0, 1, ..., i)."""
    acc: dict[str, float] = {}
    for i in range(t):
        z = delta * np.arange(i + 1, dtype=np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        n = z.size
        vals = {
            "entropy": -(p * np.log(p)).sum(),
            "max_prob": p.max(),
            "logit_std": z.std(),
            "logit_max_minus_mean": z.max() - z.mean(),
            "peaked": float(z.std() > math.sqrt(2 * math.log(n))),
            "first_key_prob": p[0],
        }
        if n > 1:
            vals["entropy_norm"] = vals["entropy"] / math.log(n)
            vals["logit_top_gap"] = delta
        for key, v in vals.items():
            acc[key] = acc.get(key, 0.0) + v
    return acc


def test_ramp_logits_match_brute_force(block_n):
    """Row i's logits are delta * j for keys j <= i (exact in float32): every statistic over
    100 rows and 7 key blocks equals a numpy float64 brute force."""
    t, delta = 100, 0.25
    q = torch.zeros(1, 1, t, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, t, 16)
    k[0, 0, :, 0] = delta * torch.arange(t, dtype=torch.float32)
    names, sums, _ = tk.kernel_head_sums(
        q.to(DEVICE), k.to(DEVICE), scaling=1.0, mask=MaskSpec()
    )
    ref = _ramp_reference(t, delta)
    for i, name in enumerate(names):
        assert sums[0, i].item() == pytest.approx(ref[name], rel=1e-5), name
    assert ref["peaked"] > 0  # long rows pass the threshold, short ones do not


def test_std_stays_accurate_when_mean_dominates(block_n):
    """Logits (20000 + small integer) / 64: |mean| ~ 312 >> std ~ 0.05, all exact in float32.
    A one-pass float32 E[z^2] - E[z]^2 loses the std entirely; the kernel's blockwise merge
    matches the float64 path to 1e-5."""
    t = 90
    g = torch.Generator().manual_seed(5)
    q = torch.zeros(1, 1, t, 16)
    q[..., 0] = 1.0
    q[..., 1] = torch.randint(1, 4, (t,), generator=g).float()
    k = torch.zeros(1, 1, t, 16)
    k[..., 0] = 20000.0
    k[..., 1] = torch.randint(-3, 4, (t,), generator=g).float()
    kw = dict(scaling=1 / 64, mask=MaskSpec(causal=False))
    got, _, ref64 = _both(q.to(DEVICE), k.to(DEVICE), **kw)
    _assert_parity(got, ref64, FP32_REL)
    # The case is hard for a naive float32 one-pass formula (so the check above means something).
    z = ((q[0, 0] @ k[0, 0].T) / 64).numpy().astype(np.float32)  # (T, T), exact
    naive = np.sqrt(np.maximum((z * z).mean(1, dtype=np.float32) - z.mean(1) ** 2, 0))
    true = z.astype(np.float64).std(1)
    assert np.abs(naive - true).max() > 1e-3 * true.max()


def test_float64_request_uses_the_torch_path():
    q, k = _qk()
    kw = dict(scaling=0.4, mask=MaskSpec(sliding_window=4), dtype=torch.float64, chunk=16)
    got = tk.attention_head_sums_triton(q.double(), k.double(), **kw)
    ref = attention_head_sums(q.double(), k.double(), **kw)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


def test_bad_inputs_are_one_line_value_errors():
    q, k = _qk()
    with pytest.raises(ValueError, match="multiple of key heads"):
        tk.attention_head_sums_triton(q, k[:, :1].expand(2, 3, 37, 8), scaling=1.0, mask=MaskSpec())
    with pytest.raises(ValueError, match="not .B|1, 1|H"):
        bad = torch.ones(2, 37, 37, dtype=torch.bool, device=DEVICE)
        tk.attention_head_sums_triton(q, k, scaling=1.0, mask=MaskSpec(mask=bad))
    with pytest.raises(ValueError, match="float32 or float64"):
        tk.attention_head_sums_triton(q, k, scaling=1.0, mask=MaskSpec(), dtype=torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        tk.set_launch_config(tk.LaunchConfig(block_n=24))


# -- a process without the interpreter: CPU refusal, ahead-of-time compilation for sm_90 -----

_NO_INTERPRETER = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from peakprobe.probes import MaskSpec
from peakprobe.probes import triton_kernel as tk

out = {"compiled": {}}
try:
    q = torch.randn(1, 2, 5, 16)
    tk.attention_head_sums_triton(q, q, scaling=1.0, mask=MaskSpec())
except ValueError as e:
    out["refused"] = str(e)
fn = triton.jit(tk._head_stats_kernel)
for qdt, kind, causal, window, softcap, rowv in json.loads(sys.argv[1]):
    cfg = tk.launch_config()
    consts = dict(MASK_KIND=kind, CAUSAL=causal, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
                  HAS_ROWV=rowv, DOT_FP32=False, BLOCK_M=64, BLOCK_N=cfg.block_n, BLOCK_D=64,
                  DOT_PRECISION=cfg.fp32_precision if qdt == "fp32" else "ieee")
    ptrs = {"q_ptr": qdt, "k_ptr": qdt, "mask_ptr": "u8" if kind < 2 else "bf16",
            "rowv_ptr": "u8", "out_ptr": "fp32"}
    sig = {n: "constexpr" if n in consts else "*" + ptrs[n] if n in ptrs
           else "fp32" if n in ("scaling", "softcap", "lowest") else "i32" for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    out["compiled"][f"{qdt}-{kind}"] = len(k.asm["cubin"])
print(json.dumps(out))
"""
#: (q dtype, mask kind, causal, window, softcap, row_valid): every constexpr branch once.
_AOT_CASES = [
    ("bf16", 0, True, True, True, True),
    ("bf16", 1, False, False, False, True),
    ("fp32", 2, False, False, True, False),
]


@pytest.fixture(scope="module")
def no_interpreter_run():
    if not RUN_HERE:  # module scope: set up before the autouse skip would apply
        pytest.skip(f"triton was imported without the interpreter here: {SUBPROCESS_TEST} runs it")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _NO_INTERPRETER, json.dumps(_AOT_CASES)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(ON_GPU, reason="a GPU process runs CUDA tensors")
def test_cpu_tensors_without_the_interpreter_are_refused(no_interpreter_run):
    """A process that imported triton without TRITON_INTERPRET gets a one-line ValueError."""
    msg = no_interpreter_run["refused"]
    assert "TRITON_INTERPRET=1" in msg and "\n" not in msg


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles and runs the kernel itself")
def test_kernel_compiles_for_hopper_without_a_gpu(no_interpreter_run):
    """Ahead-of-time compilation to sm_90 machine code (ptxas ships with triton) for each mask
    kind: the compiled path, which the interpreter does not exercise, type-checks and lowers."""
    compiled = no_interpreter_run["compiled"]
    assert sorted(compiled) == sorted(f"{c[0]}-{c[1]}" for c in _AOT_CASES)
    assert all(size > 0 for size in compiled.values())


@pytest.mark.skipif(not ON_GPU, reason="large shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, BF16_REL), (torch.float32, FP32_REL)])
@pytest.mark.parametrize("d", [64, 128])
def test_pythia_like_shapes_on_gpu(dtype, rel, d):
    """Default launch configuration, T = 1000 (many blocks), causal and left-padded bool."""
    q, k = _qk(b=2, h=8, hkv=8, tq=1000, tk_=1000, d=d, dtype=dtype, amp=1.5)
    rv = torch.ones(2, 1000, dtype=torch.bool, device=DEVICE)
    rv[1, :300] = False
    for spec in (MaskSpec(), MaskSpec(mask=_left_pad_bool(2, 1000, 1000, pads=(0, 300)))):
        kw = dict(scaling=d**-0.5, mask=spec, row_valid=rv)
        got = tk.attention_head_sums_triton(q, k, **kw)
        _assert_parity(got, attention_head_sums(q, k, **kw), rel)
