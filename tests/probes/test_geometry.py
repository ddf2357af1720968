"""Why the logits grow: the query-key geometry per head against a brute-force float64 reference
(every pair materialised, only in the test), the exact decomposition of the RMS logit, and the
growth exponents of its factors adding up on a planted run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import left_padded_batch, tiny_model

from peakprobe import vocab
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach
from peakprobe.probes.attention import MaskSpec
from peakprobe.probes.geometry import geometry_sums, geometry_values


def brute(q, k, visible, scaling):
    """Reference values per head: q (B, H, T, D), k (B, H, T, D) numpy, visible (B, H, T, T)."""
    out = {}
    qn, kn = np.linalg.norm(q, axis=-1), np.linalg.norm(k, axis=-1)
    u = np.einsum("bhid,bhjd->bhij", q, k)
    for h in range(q.shape[1]):
        v = visible[:, h]
        rows = v.any(-1)
        qq = np.broadcast_to(qn[:, h, :, None], v.shape)[v]
        kk = np.broadcast_to(kn[:, h, None, :], v.shape)[v]
        uu = u[:, h][v]
        q_rms, k_rms = math.sqrt((qq ** 2).mean()), math.sqrt((kk ** 2).mean())
        out[h] = {
            vocab.Q_NORM: qn[:, h][rows].mean(), vocab.K_NORM: kk.mean(),
            vocab.QK_COS: (uu / (qq * kk)).mean(), vocab.LOGIT_RMS: scaling * math.sqrt((uu ** 2).mean()),
            vocab.Q_RMS: q_rms, vocab.K_RMS: k_rms,
            vocab.QK_ALIGN: math.sqrt((uu ** 2).mean()) / (q_rms * k_rms),
        }
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_geometry_against_every_pair(window):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 11, 8
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) * 1.7
    row_valid = torch.ones(b, t, dtype=torch.bool)
    row_valid[1, :3] = False
    pad = torch.ones(b, 1, t, t, dtype=torch.bool)
    pad[1, :, :, :3] = False  # left padding: no query sees the first three keys of row 1
    spec = MaskSpec(mask=pad, causal=True, sliding_window=window)
    sums = geometry_sums(q, k, spec=spec, row_valid=row_valid, chunk=3)
    got = {name: v.numpy() for name, (v, _) in geometry_values(sums, 0.3).items()}
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    vis = (j <= i) & (True if window is None else (j > i - window))
    vis = np.broadcast_to(vis, (b, h, t, t)) & pad.numpy() & row_valid.numpy()[:, None, :, None]
    want = brute(q.numpy(), k.repeat_interleave(2, 1).numpy(), vis, 0.3)
    for head in range(h):
        for name, v in want[head].items():
            assert got[name][head] == pytest.approx(v, rel=1e-12), (head, name)


def test_rms_logit_decomposes_exactly_through_attach():
    model = tiny_model("llama_gqa")
    ids, mask = left_padded_batch()
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids, mask)
        frame = probe.to_frame()
    attn = frame[frame["site_kind"] == vocab.ATTN].pivot_table(index=["layer", "head"], columns="metric",
                                                               values="value")
    scaling = model.config.head_dim ** -0.5 if hasattr(model.config, "head_dim") else (32 // 4) ** -0.5
    product = scaling * attn[vocab.Q_RMS] * attn[vocab.K_RMS] * attn[vocab.QK_ALIGN]
    np.testing.assert_allclose(attn[vocab.LOGIT_RMS], product, rtol=1e-12)
    assert (attn[vocab.QK_ALIGN] <= 1 + 1e-12).all() and (attn[vocab.QK_COS].abs() <= 1).all()


@pytest.mark.slow
def test_factor_exponents_add_up_on_a_planted_run(tmp_path):
    """The helpers sequence (write_sequence) scales every head's q, k (and v) weights by (1 + step)^(1/3): for
    every peaked head, the fitted exponents of q_rms, k_rms and qk_align add up to logit_rms's
    within 0.05, the report names a norm (not the alignment) as the carrier, and the weight
    figure qk_spectral_norm grows like the two norms together (within 0.1)."""
    import json

    from helpers import STEPS, _sequence_model

    from peakprobe import results
    from peakprobe.cli import main

    for step in STEPS:  # the helpers sequence, its attention sharpened 8x more: peaked heads
        model, tok = _sequence_model(step)
        with torch.no_grad():
            for layer in model.gpt_neox.layers:
                layer.attention.query_key_value.weight.mul_(8.0)
        model.save_pretrained(tmp_path / "seq" / f"step{step}")
        tok.save_pretrained(tmp_path / "seq" / f"step{step}")
    results.write_json(tmp_path / "seq" / "schedule.json", {
        "kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 2, "total_steps": 64,
        "final_lr_ratio": 0.1})
    run = tmp_path / "run"
    assert main(["run", str(tmp_path / "seq"), "--out", str(run), "--n-windows", "4", "--window", "24",
                 "--n-boot", "200", "--no-sensitivity", "-q"]) == 0
    summary = json.loads((run / "report" / "summary.json").read_text())
    f = summary["logit_factors"]
    assert f["measured"] and f["rows"] and f["heads_of"] == "peaked heads"
    for r in f["rows"]:
        assert abs(r["alpha_sum"] - r["alpha_logit_rms"]) < 0.05, r
        assert r["carrier"] in ("query norm", "key norm"), r
        # the planted growth is in the q/k weights: their product's norm carries the norms' sum
        assert abs(r[f"alpha_{vocab.QK_SPECTRAL}"] - r["alpha_q_rms"] - r["alpha_k_rms"]) < 0.1, r
    assert "## Why the logits grow" in (run / "report" / "summary.md").read_text()
    assert "‖W_Qᵀ W_K‖ α" in (run / "report" / "summary.md").read_text()
    assert 'id="logit-factors-table"' in (run / "report" / "report.html").read_text()
    fits = pd.read_parquet(run / "fits.parquet")  # the robust fits of each factor too
    assert set(vocab.LOGIT_FACTORS) | {vocab.QK_SPECTRAL} <= set(fits[fits.fit == vocab.FIT_GROWTH].metric)


def test_lm_head_factors_against_the_model():
    """mean log Z, the hidden-state norm and the unembedding row norm of the LM head against the
    model's own float64 logits, last hidden state and weights over the kept (non-padding) rows."""
    model = tiny_model("llama_gqa")
    ids, mask = left_padded_batch()
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids, mask)
        frame = probe.to_frame()
    lm = frame[frame["site_kind"] == vocab.LM_HEAD].set_index("metric")
    with torch.no_grad():
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
        z = model.lm_head(h)  # (B, T, V)
    kept = mask.bool()
    assert lm.at[vocab.LOG_Z, "value"] == pytest.approx(float(torch.logsumexp(z, -1)[kept].mean()), rel=1e-12)
    assert lm.at[vocab.HIDDEN_NORM, "value"] == pytest.approx(float(h.norm(dim=-1)[kept].mean()), rel=1e-12)
    w = model.lm_head.weight.detach()
    assert lm.at[vocab.UNEMBED_NORM, "value"] == pytest.approx(float(w.norm(dim=-1).mean()), rel=1e-12)
    assert int(lm.at[vocab.UNEMBED_NORM, "n_rows"]) == w.shape[0]
