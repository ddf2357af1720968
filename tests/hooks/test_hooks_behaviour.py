"""Hooks: a constructed peaked head, hook hygiene, unsupported models (sensitivity: test_attribution)."""

from __future__ import annotations

import gc
import math
import weakref

import pandas as pd
import pytest
import torch
from helpers import VOCAB, left_padded_batch, tiny_model
from transformers import AutoModelForCausalLM, GPT2Config, MambaConfig

from peakprobe.config import ProbeConfig
from peakprobe.hooks import UnsupportedModelError, attach


def _unit_rows(c: torch.Tensor, d: int, seed: int = 0) -> torch.Tensor:
    """Rows with first coordinate c_v, mean 0 and population std 1 (LayerNorm leaves them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for cv in c.tolist():
        w = torch.randn(d - 1, generator=g, dtype=torch.float64)
        w = w - w.mean()
        w = w / w.norm()
        t = math.sqrt(d - cv * cv - cv * cv / (d - 1))
        rows.append(torch.cat([torch.tensor([cv], dtype=torch.float64), -cv / (d - 1) + t * w]))
    return torch.stack(rows)


def test_constructed_peaked_head_has_the_analytic_top_gap():
    d, heads, amp = 32, 4, 400.0
    head_dim = d // heads
    cfg = GPT2Config(n_embd=d, n_layer=1, n_head=heads, vocab_size=VOCAB, n_positions=64,
                     layer_norm_epsilon=0.0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    c = torch.linspace(-2.0, 2.0, VOCAB, dtype=torch.float64)  # token v's key coordinate
    with torch.no_grad():
        model.transformer.wte.weight.copy_(_unit_rows(c, d))
        model.transformer.wpe.weight.zero_()
        attn = model.transformer.h[0].attn.c_attn  # Conv1D: out = x @ W + b, W (d, 3d)
        attn.weight[:, :head_dim] = 0.0  # head 0 query: a constant, from the bias
        attn.bias[:head_dim] = 0.0
        attn.bias[0] = amp
        attn.weight[:, d : d + head_dim] = 0.0  # head 0 key: the token's coordinate c_v
        attn.bias[d : d + head_dim] = 0.0
        attn.weight[0, d] = 1.0
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:20] for _ in range(2)])  # distinct
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids)
        df = probe.to_frame()
    head = df[(df.site_kind == "attn") & (df.layer == 0) & (df["head"] == 0)].set_index("metric")
    # Analytic: the score of key j is amp * c[token_j] / sqrt(head_dim); the gap of each row is
    # that factor times the difference of the two largest c among its visible tokens.
    gaps = []
    for row in ids:
        for q in range(1, len(row)):
            top = sorted(c[row[: q + 1]].tolist(), reverse=True)
            gaps.append(amp / math.sqrt(head_dim) * (top[0] - top[1]))
    assert head.loc["logit_top_gap", "value"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
    assert head.loc["max_prob", "value"] > 0.99
    assert head.loc["peaked", "value"] > 0.5
    other = df[(df.site_kind == "attn") & (df["head"] == 1)].set_index("metric")
    assert other.loc["max_prob", "value"] < 0.9


def test_attach_restores_everything_and_releases_the_model():
    model = tiny_model("llama_gqa")
    original = model.config._attn_implementation
    ids, mask = left_padded_batch()
    with pytest.raises(RuntimeError, match="boom"):
        with attach(model, ProbeConfig()) as probe:
            probe.run_batch(ids, mask)
            raise RuntimeError("boom")
    assert model.config._attn_implementation == original
    with attach(model, ProbeConfig()) as probe:
        assert model.config._attn_implementation.startswith("peakprobe_")
        probe.run_batch(ids, mask)
    assert model.config._attn_implementation == original
    assert all(p.requires_grad for p in model.parameters())
    hooks = [m._forward_hooks for m in model.modules()] + [m._forward_pre_hooks for m in model.modules()]
    assert all(len(h) == 0 for h in hooks)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert not [k for k in AttentionInterface._global_mapping if k.startswith("peakprobe")]
    assert not [k for k in AttentionMaskInterface._global_mapping if k.startswith("peakprobe")]
    ref = weakref.ref(model)
    del model, probe
    gc.collect()
    assert ref() is None


def test_model_without_softmax_attention_is_refused_by_name():
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        with attach(model):
            pass


def test_run_batch_returns_the_mean_next_token_loss_in_both_modes():
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    tgt = torch.where(mask[:, 1:].bool() & mask[:, :-1].bool(), ids[:, 1:], -100)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100
    ).item()
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        assert probe.run_batch(ids, mask) == pytest.approx(expected, rel=1e-12)


def test_attention_blocks_are_sized_per_device():
    """On CPU the default is CPU_CHUNK rows a block (explicit chunks win everywhere); on a GPU
    the largest power of two, at least CPU_CHUNK, whose logits fit GPU_BLOCK_ELEMENTS — against
    a brute-force search over powers of two."""
    from peakprobe.hooks.engine import CPU_CHUNK, GPU_BLOCK_ELEMENTS, block_rows, gpu_rows

    q, k = torch.zeros(2, 4, 16, 8), torch.zeros(2, 2, 16, 8)
    assert block_rows(None, q, k) == CPU_CHUNK and block_rows(7, q, k) == 7
    for b, h, t in [(8, 12, 2048), (8, 16, 2048), (1, 1, 7), (64, 40, 4096), (3, 5, 1000)]:
        fits = [1 << i for i in range(40) if b * h * t * (1 << i) <= GPU_BLOCK_ELEMENTS]
        assert gpu_rows(b, h, t) == max([CPU_CHUNK] + fits), (b, h, t)
    assert gpu_rows(8, 12, 2048) == 128 and gpu_rows(64, 40, 4096) == CPU_CHUNK


def test_a_mask_the_kernel_ranges_cannot_express_is_probed_again_on_the_torch_path(monkeypatch):
    """A custom 4-D mask with a hole (rows 5.. do not see key 2) is not one key interval per row:
    the kernel path counts it, and ``run_batch`` probes that batch again on the torch path, so
    the frame is the torch path's exactly. The kernel is stood in for by the torch path on the
    ranges (right wherever the ranges are), so the test runs without triton."""
    import sys
    import types

    from peakprobe.hooks import engine
    from peakprobe.hooks.engine import SiteStats
    from peakprobe.probes import MaskSpec, attention_head_sums
    from peakprobe.probes.ranges import KeyRanges, ranges_mask

    calls = []

    def kernel_site_sums(query, key, *, scaling, start, end, row_valid=None, softcap=None, sinks=None):
        calls.append(query.shape)
        spec = MaskSpec(mask=ranges_mask(KeyRanges(start, end, torch.zeros(())), key.shape[2]))
        return attention_head_sums(query, key, scaling=scaling, mask=spec, row_valid=row_valid,
                                   softcap=softcap, sinks=sinks, dtype=torch.float64)

    fake = types.ModuleType("peakprobe.probes.triton_kernel")
    fake.kernel_site_sums = kernel_site_sums
    fake.kernel_supported = lambda *a, **k: True

    def stand_in():  # the kernel module and triton's presence stood in for; the LM head on torch
        monkeypatch.setitem(sys.modules, "peakprobe.probes.triton_kernel", fake)
        monkeypatch.setattr(engine, "triton_available", lambda: True)
        monkeypatch.setattr(SiteStats, "_lm_kernel", lambda self, logits: False)

    stand_in()
    model = tiny_model("llama_gqa")
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    holes = causal.clone()
    holes[5:, 2] = False
    frames = {}
    for name, mask in (("holes", holes), ("causal", causal)):
        mask4 = mask.view(1, 1, 10, 10).expand(2, 1, 10, 10)
        with attach(model, ProbeConfig(dtype="float64", backend="torch")) as probe:
            probe.run_batch(ids, mask4)
            reference = probe.to_frame()
        monkeypatch.setattr(SiteStats, "_kernel", lambda self, q, k, spec, kw: self.config.backend != "torch")
        calls.clear()
        with attach(model, ProbeConfig(dtype="float64", backend="triton")) as probe:
            probe.run_batch(ids, mask4)
            frames[name] = probe.to_frame()
        monkeypatch.undo()
        stand_in()
        assert len(calls) == model.config.num_hidden_layers  # the kernel path ran first
        pd.testing.assert_frame_equal(frames[name], reference, check_exact=False, rtol=1e-12)
    # without the second pass the hole would show: the ranges alone see key 2 from every row
    assert not frames["holes"].equals(frames["causal"])
