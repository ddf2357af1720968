"""MoE routers as softmax sites: exact against a float64 eager reference on tiny random models.

Each architecture's model runs in float32 (its expert matmuls refuse float64); the reference
takes the router logits the model itself returns with ``output_router_logits=True`` and
recomputes every statistic token by token in numpy float64 (softmax over the experts, top-k
from a full argsort, loads from counting), independently of ``peakprobe.probes``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import VOCAB, left_padded_batch
from scipy.special import logsumexp
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from peakprobe import vocab
from peakprobe.attribution.search import EXTEND_LIMIT
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach
from peakprobe.hooks.moe import find_routers

REL = 1e-9
E, K = 6, 2


def moe_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=K)
    if arch == "olmoe":
        return OlmoeConfig(num_experts=E, **common)
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=E, **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=E, moe_intermediate_size=16, head_dim=8, **common)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(num_experts=E, moe_intermediate_size=16,
                              shared_expert_intermediate_size=16, **common)
    raise KeyError(arch)


MOE_ARCHS = ["olmoe", "mixtral", "qwen3_moe", "qwen2_moe"]


def moe_model(arch: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    kwargs = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # float64 experts
    model = AutoModelForCausalLM.from_config(moe_config(arch), dtype=dtype, **kwargs).eval()
    with torch.no_grad():  # spread the router logits so rows differ in peakedness
        for r in find_routers(model):
            r.module.weight.mul_(8.0)
    return model


def reference(logits: np.ndarray, kept: np.ndarray, k: int) -> dict[str, float]:
    """Float64 row means and load figures of router logits (N, E) over the kept tokens."""
    z = logits[kept].astype(np.float64)
    n, e = z.shape
    lse = logsumexp(z, axis=1, keepdims=True)
    logp = z - lse
    p = np.exp(logp)
    std = z.std(axis=1)
    srt = np.sort(z, axis=1)[:, ::-1]
    top = np.argsort(-z, axis=1, kind="stable")[:, :k]
    load = np.bincount(top.reshape(-1), minlength=e).astype(float)
    share = load / load.sum()
    out = {
        vocab.ENTROPY: -(p * logp).sum(1).mean(),
        vocab.ENTROPY_NORM: (-(p * logp).sum(1) / math.log(e)).mean(),
        vocab.MAX_PROB: p.max(1).mean(),
        vocab.LOGIT_STD: std.mean(),
        vocab.LOGIT_MAX_MINUS_MEAN: (z.max(1) - z.mean(1)).mean(),
        vocab.LOGIT_TOP_GAP: (srt[:, 0] - srt[:, 1]).mean(),
        vocab.LOGIT_ROW_MAX: z.max(1).mean(),
        vocab.PEAKED: (std > math.sqrt(2 * math.log(e))).mean(),
        vocab.TOPK_MASS: np.take_along_axis(p, top, 1).sum(1).mean(),
        vocab.LOGIT_MAX: z.max(),
        vocab.LOAD_ENTROPY: -(share[share > 0] * np.log(share[share > 0])).sum(),
        vocab.DEAD_EXPERTS: (load == 0).mean(),
        vocab.LOAD_MAX_OVER_MEAN: load.max() / load.mean(),
    }
    return {name: float(v) for name, v in out.items()}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_statistics_exact(arch):
    model = moe_model(arch)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    captured = [x.detach().numpy() for x in out.router_logits]
    assert len(captured) == 2
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids, mask)
        frame = probe.to_frame()
    routers = frame[frame["site_kind"] == vocab.ROUTER]
    assert sorted(routers["layer"].unique()) == [0, 1]
    kept = mask.reshape(-1).bool().numpy()
    for layer, logits in enumerate(captured):
        got = routers[routers["layer"] == layer].set_index("metric")
        want = reference(logits, kept, K)
        for name, v in want.items():
            assert got.at[name, "value"] == pytest.approx(v, rel=REL, abs=1e-12), (arch, layer, name)
        assert int(got.at[vocab.ENTROPY, "n_rows"]) == int(kept.sum())
        assert set(vocab.ROUTER_PROBE_METRICS + vocab.LOAD_METRICS) <= set(got.index)
    # the load figures are not trivial on these models
    assert routers[routers["metric"] == vocab.LOAD_MAX_OVER_MEAN]["value"].max() > 1.0


def test_router_labels_and_hooks_removed():
    model = moe_model("olmoe")
    assert vocab.site_label(vocab.ROUTER, 3) == "router L3"
    routers = find_routers(model)
    assert [r.layer for r in routers] == [0, 1] and all(r.top_k == K for r in routers)
    with attach(model, ProbeConfig()):
        pass
    assert all(not r.module._forward_hooks for r in routers)


def test_dense_model_has_no_router():
    from helpers import tiny_model

    assert find_routers(tiny_model("llama_gqa")) == []


MOE_STEPS = [0, 1, 2, 4, 8, 16, 32, 64]


def write_moe_sequence(folder, steps=MOE_STEPS) -> None:
    """save_pretrained folders step<N>/ of a tiny OLMoE whose router logits grow like
    (1 + step)^(1/3) (its router weights scaled), plus a schedule."""
    from peakprobe import results
    from peakprobe.corpus import build_tokenizer

    tok = build_tokenizer()
    cfg = OlmoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      num_experts=E, num_experts_per_tok=K, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for step in steps:
        torch.manual_seed(2000 + step)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for r in find_routers(model):
                r.module.weight.mul_(4.0 * (1 + step) ** (1 / 3))
        model.save_pretrained(folder / f"step{step}")
        tok.save_pretrained(folder / f"step{step}")
    results.write_json(folder / "schedule.json", {
        "kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 2, "total_steps": 64,
        "final_lr_ratio": 0.1,
    })


@pytest.mark.slow
def test_moe_sequence_runs_end_to_end(tmp_path):
    """``peakprobe run`` on a tiny OLMoE sequence: router sites in fits.parquet (growth near the
    planted 1/3), the heads table, the digest, summary.md, the HTML and the router figure."""
    import json

    import pandas as pd

    from peakprobe.cli import main

    write_moe_sequence(tmp_path / "seq")
    run = tmp_path / "run"
    assert main(["run", str(tmp_path / "seq"), "--out", str(run), "--n-windows", "4", "--window", "24",
                 "--n-boot", "200", "--no-sensitivity", "-q"]) == 0
    fits = pd.read_parquet(run / "fits.parquet")
    growth = fits[(fits.site_kind == vocab.ROUTER) & (fits.fit == vocab.FIT_GROWTH)]
    std = growth[growth.metric == vocab.LOGIT_STD].set_index("layer")
    assert sorted(std.index) == [0, 1]
    assert ((std.alpha_lo < 1 / 3) & (std.alpha_hi > 1 / 3)).all(), std[["alpha", "alpha_lo", "alpha_hi"]]
    assert set(growth.metric) >= {vocab.TOPK_MASS, vocab.LOAD_ENTROPY, vocab.LOAD_MAX_OVER_MEAN}
    assert (std.verdict != "").all()
    heads = pd.read_parquet(run / "report" / "heads.parquet")
    assert (heads.site_kind == vocab.ROUTER).sum() == 2
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert [r["label"] for r in summary["routers"]] == ["router L0", "router L1"]
    assert summary["routers"][0]["alpha"] == pytest.approx(std.at[0, "alpha"])
    assert "## MoE routers" in (run / "report" / "summary.md").read_text()
    assert 'id="routers-table"' in (run / "report" / "report.html").read_text()
    assert "router_curves" in summary["figures"]


@pytest.mark.slow
def test_router_gain_against_scaled_weights():
    """G, log beta_opt and the slope of each router against an independent computation: the
    router's weight matrix scaled by beta (not its input), the float64 loss on a grid of log
    beta refined by scipy's bounded scalar minimisation."""
    from scipy.optimize import minimize_scalar

    from peakprobe.attribution.routers import router_gains

    model = moe_model("olmoe", seed=3, dtype=torch.float64)
    ids, mask = left_padded_batch(seed=4)
    frame = router_gains(model, [(ids, mask)]).set_index(["layer", "metric"])["value"]
    ok = (mask[:, 1:] * mask[:, :-1]).bool()

    def loss(layer: int, x: float) -> float:
        w = find_routers(model)[layer].module.weight
        saved = w.detach().clone()
        with torch.no_grad():
            w.mul_(math.exp(x))
            z = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, T-1, V) float64
            w.copy_(saved)
        ce = torch.logsumexp(z, -1) - z.gather(-1, ids[:, 1:, None])[..., 0]
        return float(ce[ok].mean())

    for layer in (0, 1):
        f0 = loss(layer, 0.0)
        reach = EXTEND_LIMIT  # the search's reach in log beta, past its first bounds
        grid = np.linspace(-reach, reach, 97)
        values = [loss(layer, x) for x in grid]
        best = grid[int(np.argmin(values))]
        fine = minimize_scalar(lambda x, layer=layer: loss(layer, x),
                               bounds=(max(-reach, best - 0.25), min(reach, best + 0.25)), method="bounded",
                               options={"xatol": 1e-5})
        g_ref = f0 - min(min(values), fine.fun)
        assert g_ref > 1e-4  # a gain to find
        assert frame[(layer, vocab.GAIN)] == pytest.approx(g_ref, rel=0.02, abs=1e-7)
        x = frame[(layer, vocab.LOG_BETA_OPT)]
        if abs(x) < reach:
            assert x == pytest.approx(fine.x, abs=0.02)
        else:  # the loss flattens toward the reach's end (a uniform router): the minimiser is loose
            assert f0 - loss(layer, x) == pytest.approx(g_ref, rel=0.02, abs=1e-7)
        # the router's own softmax runs in float32 even in a float64 model: a wide central
        # difference (truncation ~h^2, rounding ~1e-7 / h, both under 1e-3 of the slope)
        slope = (loss(layer, 1e-2) - loss(layer, -1e-2)) / 2e-2
        assert frame[(layer, vocab.SENSITIVITY)] == pytest.approx(slope, rel=2e-3, abs=1e-8)
    assert all(not r.module._forward_pre_hooks for r in find_routers(model))
