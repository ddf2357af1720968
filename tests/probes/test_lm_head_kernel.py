"""Parity of the LM-head kernel (``peakprobe.probes.triton_lm_head``) with float64.

Marker ``triton``; skipped without triton. On CPU the kernel runs under Triton's interpreter
(this module sets ``TRITON_INTERPRET=1`` before triton is first imported; when another module
imported triton without it, one test runs this file again in a fresh process).
``PEAKPROBE_TRITON_DEVICE=cuda`` runs the same checks compiled on a GPU.

The logits are the real outputs of the 8 tiny architectures of the hook tests (Gemma-2's final
softcapping included), in float32 and bfloat16, with left-padded positions left out. Two references:

* per position, every LM-head statistic straight from the dense float64 logits (logsumexp,
  softmax, ``std``, ``topk``, ``gather``): no code of the package;
* per site, the torch path in float64 (``SiteStats`` with ``backend="torch"``), the exact
  reference: every metric of the frame, the largest logit and the histogram quantiles.

Tolerances: ``REL = 2e-5`` relative (the kernel sums in float32 over up to 97 (models) and
5,000 (synthetic) logits; measured under the interpreter: at most 3e-6), ``beta_eff`` 2e-4;
0/1 flags exactly; the histogram quantiles within one bin.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.extras import missing

DEVICE = os.environ.get("PEAKPROBE_TRITON_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton

pytest.importorskip("triton", reason=missing("triton", "triton is not installed (pip install triton)"),
                    exc_type=ImportError)

from helpers import ARCHS, left_padded_batch  # noqa: E402
from helpers.reference import tiny_model  # noqa: E402

from peakprobe import vocab  # noqa: E402
from peakprobe.config import ProbeConfig  # noqa: E402
from peakprobe.hooks.engine import SiteStats, lm_targets  # noqa: E402
from peakprobe.probes import triton_kernel as tk  # noqa: E402
from peakprobe.probes import triton_lm_head as lm  # noqa: E402
from peakprobe.probes.rows import finish  # noqa: E402

pytestmark = pytest.mark.triton
RUN_HERE = ON_GPU or tk.INTERPRETED
REL = 2e-5
BETA_REL = 2e-4
ALL_ARCHS = ARCHS + ["gpt_oss"]

if not RUN_HERE:

    def test_this_file_in_an_interpreter_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p",
                              "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


@pytest.fixture(autouse=True)
def _only_where_the_kernel_runs(request):
    if not RUN_HERE and request.node.name != "test_this_file_in_an_interpreter_subprocess":
        pytest.skip("triton was imported without the interpreter here")


def reference_rows(z: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every LM-head statistic per position from dense float64 logits z (..., V)."""
    z = z.to(torch.float64)
    lse = z.logsumexp(-1)
    logp = z - lse.unsqueeze(-1)
    top = z.topk(2, -1).values
    zt = z.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mean = z.mean(-1)
    return {
        vocab.ENTROPY: -(logp.exp() * logp).sum(-1),
        vocab.MAX_PROB: logp.amax(-1).exp(),
        vocab.LOGIT_STD: z.std(-1, correction=0),
        vocab.LOGIT_MAX_MINUS_MEAN: top[..., 0] - mean,
        vocab.LOGIT_TOP_GAP: top[..., 0] - top[..., 1],
        vocab.LOGIT_ROW_MAX: top[..., 0],
        vocab.LOSS: lse - zt,
        vocab.TARGET_PROB: (zt - lse).exp(),
        vocab.TARGET_LOGIT_MINUS_MEAN: zt - mean,
    }


def assert_rows_match(z: torch.Tensor, target: torch.Tensor, kept: torch.Tensor) -> None:
    keys, zt = lm.lm_head_sums(z, target)
    got = finish(keys, kept, target_logit=zt, n_max=z.shape[-1])
    ref = reference_rows(z.cpu(), target.cpu())
    for name, want in ref.items():
        w = got.weight[name].cpu() > 0
        have = got.values[name].cpu()
        scale = want.abs().clamp(min=1.0) if name != vocab.TARGET_PROB else want.abs().clamp(min=1e-30)
        err = ((have - want).abs() / scale)[w]
        assert err.numel() > 0 and float(err.max()) < REL, (name, float(err.max()))


def model_logits(arch: str, dtype: torch.dtype):
    model = tiny_model(arch)
    ids, mask = left_padded_batch()
    with torch.no_grad():  # the padding mask is the LM head's (kept positions), not the model's
        z = model(input_ids=ids).logits  # (B, T, V), the model's final logits
    return z.to(dtype).to(DEVICE), ids.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_architectures_lm_head_match_float64(arch, dtype):
    """Each architecture's logits: per position against dense float64, per site against the
    torch path in float64 (every metric, the largest logit, the quantiles)."""
    z, ids, mask = model_logits(arch, dtype)
    if arch == "gemma2_softcap":
        assert float(z[mask.bool()].abs().max()) <= 3.0  # the final softcapping is in the logits
    kept, target = lm_targets(ids, mask)
    assert_rows_match(z, target, kept)
    frames = {}
    for backend, dt in (("triton", "float32"), ("torch", "float64")):
        stats = SiteStats(ProbeConfig(backend=backend, dtype=dt))
        stats.lm_head(z, kept, target)
        frames[backend] = stats.accumulator.to_frame().set_index("metric")
        _, loss = stats.end_batch()
        frames[backend + "_loss"] = loss
    a, b = frames["triton"], frames["torch"]
    assert (a["n_rows"] == b["n_rows"]).all()
    assert abs(frames["triton_loss"] - frames["torch_loss"]) < REL * abs(frames["torch_loss"])
    width = {name: (hi - lo) / vocab.HIST_BINS for name, (lo, hi) in vocab.HIST_RANGE.items()}
    for metric in b.index:
        x, y = float(a.loc[metric, "value"]), float(b.loc[metric, "value"])
        if any(metric == vocab.quantile_metric(n, q) for n in vocab.QUANTILE_OF for q in vocab.QUANTILES):
            name = next(n for n in vocab.QUANTILE_OF if metric.startswith(n))
            assert abs(x - y) <= width[name] + 1e-12, metric
        else:
            rel = BETA_REL if metric == vocab.BETA_EFF else REL
            assert abs(x - y) <= rel * max(abs(y), 1.0), (metric, x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("v", [2, 1023, 5000])
def test_vocab_tiles_offsets_and_ties(v, dtype):
    """Vocabularies of one partial tile, of full tiles plus a partial one; logits far from 0
    (mean >> std: the sums relative to the first logit stay accurate) and tied maxima."""
    g = torch.Generator().manual_seed(v)
    z = (torch.randn(3, 7, v, generator=g) * 2.0 + 300.0)
    z[0, 2, v // 2] = z[0, 2, 0] = z[0, 2].max() + 1.0  # a tie at the top: top gap 0
    z = z.to(dtype).to(DEVICE)
    target = torch.randint(0, v, (3, 7), generator=g).to(DEVICE)
    target[1, 3] = -1
    kept = torch.ones(3, 7, dtype=torch.bool, device=DEVICE)
    assert_rows_match(z, target, kept)
    keys, _ = lm.lm_head_sums(z, target)
    assert float(keys.m[0, 2] - keys.m2[0, 2]) == 0.0


def test_identical_logits_are_uniform_closed_form():
    v = 1500
    z = torch.full((2, 3, v), 4.25, device=DEVICE)
    target = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    keys, zt = lm.lm_head_sums(z, target)
    got = finish(keys, torch.ones(2, 3, dtype=torch.bool, device=DEVICE), target_logit=zt, n_max=v)
    assert torch.allclose(got.values[vocab.ENTROPY].cpu(), torch.full((2, 3), torch.tensor(v).log().item(),
                                                                       dtype=torch.float64), rtol=1e-6)
    assert float(got.values[vocab.LOGIT_STD].abs().max()) == 0.0
    assert float(got.values[vocab.LOGIT_TOP_GAP].abs().max()) == 0.0
    assert torch.allclose(got.values[vocab.LOSS].cpu(), torch.full((2, 3), float(torch.tensor(v).log()),
                                                                    dtype=torch.float64), rtol=1e-6)


def test_the_engine_takes_the_kernel_and_bad_input_is_one_line():
    z, ids, mask = model_logits("llama_gqa", torch.bfloat16)
    kept, target = lm_targets(ids, mask)
    stats = SiteStats(ProbeConfig(backend="triton"))
    assert stats._lm_kernel(z) and not SiteStats(ProbeConfig(backend="triton", dtype="float64"))._lm_kernel(z)
    with pytest.raises(lm.LmHeadKernelError) as err:
        lm.lm_head_record(z, target[:, :-1])
    assert "\n" not in str(err.value)
    with pytest.raises(lm.LmHeadKernelError):
        lm.lm_head_record(z.to(torch.float64), target)
