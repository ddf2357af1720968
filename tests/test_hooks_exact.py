"""Exactness of the attention-interface probes against an independent eager reference.

The reference runs a second copy of each model with transformers' own eager attention in
float64 and captures the scores each eager attention hands to its softmax (scaling, softcapping
and the eager mask applied by the model itself; eager softmaxes in float32, so its probabilities
cannot serve). Every statistic is then recomputed row by row in numpy, with the visible keys
stated independently (causal, padding, sliding window). The probed model runs its default
(sdpa or eager) path, with a left-padded batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import ARCHS, left_padded_batch, tiny_config, tiny_model

from peakprobe.hooks import ProbeConfig, attach

REL = 1e-9


def _eager_scores(arch: str, ids: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """The (B, H, T, T) float64 inputs of every eager attention softmax, in layer order."""
    model = tiny_model(arch, attn="eager")
    captured: list[np.ndarray] = []
    real_softmax = torch.nn.functional.softmax

    def recording_softmax(x, *args, **kwargs):
        if x.dim() == 4:
            captured.append(x.detach().numpy().copy())
        return real_softmax(x, *args, **kwargs)

    torch.nn.functional.softmax = recording_softmax
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        torch.nn.functional.softmax = real_softmax
    assert len(captured) == tiny_config(arch).num_hidden_layers
    return captured


def _row_stats(z: np.ndarray, p_first: bool) -> dict[str, float]:
    zs = z - z.max()
    p = np.exp(zs) / np.exp(zs).sum()
    n = z.size
    srt = np.sort(z)[::-1]
    entropy = float(-(p * np.log(p)).sum())
    vals = {
        "entropy": entropy,
        "max_prob": float(p.max()),
        "logit_std": float(z.std()),
        "logit_max_minus_mean": float(z.max() - z.mean()),
        "peaked": float(z.std() > math.sqrt(2 * math.log(n))),
    }
    if p_first:
        vals["first_key_prob"] = float(p[0])
    if n > 1:
        vals["entropy_norm"] = entropy / math.log(n)
        vals["logit_top_gap"] = float(srt[0] - srt[1])
    return vals


def _reference_attention(arch: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    cfg = tiny_config(arch)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    m = mask.numpy()
    ref: dict = {}
    for layer, scores in enumerate(_eager_scores(arch, ids, mask)):
        sliding = window is not None and (
            layer_types[layer] == "sliding_attention" or arch == "mistral_sliding"
        )
        for h in range(scores.shape[1]):
            acc: dict[str, list[float]] = {}
            for b in range(scores.shape[0]):
                for q in range(scores.shape[2]):
                    if m[b, q] == 0:
                        continue
                    keys = [
                        k for k in range(q + 1) if m[b, k] == 1 and (not sliding or q - k < window)
                    ]
                    hidden = [k for k in range(scores.shape[3]) if k not in keys]
                    # The eager mask agrees with our statement of what is visible (masked scores
                    # are the float64 minimum, or NaN where eager float64 overflowed upstream).
                    assert not np.any(scores[b, h, q, hidden] > -1e300)
                    for k_, v in _row_stats(scores[b, h, q, keys], True).items():
                        acc.setdefault(k_, []).append(v)
            for k_, v in acc.items():
                ref[("attn", layer, h, k_)] = (float(np.mean(v)), len(v))
    return ref


def _reference_lm(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> dict:
    acc: dict[str, list[float]] = {}
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if mask[b, t] == 0:
                continue
            z = logits[b, t]
            vals = _row_stats(z, False)
            if t + 1 < ids.shape[1] and mask[b, t + 1] == 1:
                y = ids[b, t + 1]
                logp_y = z[y] - z.max() - np.log(np.exp(z - z.max()).sum())
                vals["loss"] = float(-logp_y)
                vals["target_prob"] = float(np.exp(logp_y))
                vals["target_logit_minus_mean"] = float(z[y] - z.mean())
            for k_, v in vals.items():
                acc.setdefault(k_, []).append(v)
    return {("lm_head", -1, -1, k): (float(np.mean(v)), len(v)) for k, v in acc.items()}


def _probe(model, ids, mask):
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    with attach(model, ProbeConfig(dtype="float64", chunk=5)) as probe:
        with torch.no_grad():
            probed = model(input_ids=ids, attention_mask=mask).logits
        df = probe.to_frame()
    # The model's own attention path produced the output: identical, not merely close (eager
    # float64 in transformers turns padded sequences into NaN: NaN must stay NaN).
    torch.testing.assert_close(probed, plain, rtol=0, atol=0, equal_nan=True)
    got = {(r.site_kind, r.layer, r.head, r.metric): (r.value, r.n_rows) for r in df.itertuples()}
    return got, probed


def _assert_match(got: dict, ref: dict) -> None:
    for key, (value, n) in ref.items():
        gv, gn = got[key]
        assert gn == n, key
        assert gv == pytest.approx(value, rel=REL, abs=1e-12), key


@pytest.mark.parametrize("arch", ARCHS)
def test_statistics_match_eager_reference(arch):
    """Probing a model whose attention is eager: every attention site of every layer, to 1e-9.

    (The LM head is checked on the default path below: eager float64 with padding gives NaN.)"""
    ids, mask = left_padded_batch()
    got, _ = _probe(tiny_model(arch, attn="eager"), ids, mask)
    ref = _reference_attention(arch, ids, mask)
    assert {k for k in got if k[0] == "attn"} == set(ref)
    assert {k[1] for k in got if k[0] == "attn"} == set(range(tiny_config(arch).num_hidden_layers))
    _assert_match(got, ref)
    # Not trivial: some head is far from uniform.
    assert max(v for k, (v, _) in got.items() if k[0] == "attn" and k[3] == "logit_std") > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_default_attention_path_masks_match_eager_reference(arch):
    """Probing the model's default path (sdpa: boolean or skipped masks): outputs unchanged,
    first layer (identical inputs to the eager reference) exact, LM head exact."""
    ids, mask = left_padded_batch()
    got, logits = _probe(tiny_model(arch), ids, mask)
    ref = _reference_attention(arch, ids, mask)
    first = {k: v for k, v in ref.items() if k[1] == 0}
    _assert_match(got, first)
    if torch.isnan(logits).any():
        # Gemma-2 defaults to eager, whose float64 path NaNs padded sequences: check its LM
        # head (final softcapping included) on the unpadded rows instead.
        ids, mask = ids[:1], mask[:1]
        got, logits = _probe(tiny_model(arch), ids, mask)
    _assert_match(got, _reference_lm(logits.numpy(), ids.numpy(), mask.numpy()))


def test_chunk_size_does_not_change_results():
    ids, mask = left_padded_batch()
    model = tiny_model("llama_gqa")
    frames = []
    for chunk in (1, 3, 64):
        with attach(model, ProbeConfig(dtype="float64", chunk=chunk)) as probe:
            probe.run_batch(ids, mask)
            frames.append(probe.to_frame())
    for other in frames[1:]:
        np.testing.assert_allclose(other["value"], frames[0]["value"], rtol=1e-12, atol=1e-14)
        assert other["n_rows"].tolist() == frames[0]["n_rows"].tolist()


def test_batches_merge_to_the_same_means_as_one_batch():
    ids, mask = left_padded_batch(batch=3)
    model = tiny_model("gpt_neox")
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids, mask)
        whole = probe.to_frame()
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids[:1], mask[:1])
        probe.run_batch(ids[1:], mask[1:])
        split = probe.to_frame()
    np.testing.assert_allclose(split["value"], whole["value"], rtol=1e-12, atol=1e-14)
    assert split["n_rows"].tolist() == whole["n_rows"].tolist()
