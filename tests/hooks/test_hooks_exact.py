"""Exactness of the attention-interface probes against an independent eager reference.

The reference runs a second copy of each model with transformers' own eager attention in
float64 and captures the scores each eager attention hands to its softmax (scaling, softcapping
and the eager mask applied by the model itself; eager softmaxes in float32, so its probabilities
cannot serve). Every statistic is then recomputed row by row in numpy, with the visible keys
stated independently (causal, padding, sliding window). The probed model runs its default
(sdpa or eager) path, with a left-padded batch.

Besides the seven architectures of ``helpers.ARCHS`` a tiny gpt-oss checks the learned sink
logit: its eager softmax sees the scores with the sink appended as a last column. The
entropy-equivalent beta_eff is checked against an independent inversion (scipy's brentq on a
numpy re-implementation of the tabulated curve).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import left_padded_batch
from helpers.reference import ALL_ARCHS, _row_stats, tiny_config, tiny_model

from peakprobe import vocab
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach

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


def _reference_attention(arch: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    cfg = tiny_config(arch)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    m = mask.numpy()
    ref: dict = {}
    if arch == "gpt_oss":
        model = tiny_model(arch, attn="eager")
        sink_logits = [layer.self_attn.sinks.detach() for layer in model.model.layers]
    for layer, scores in enumerate(_eager_scores(arch, ids, mask)):
        sinks = None
        if arch == "gpt_oss":
            # The eager softmax sees the sink logit as a last column, every row shifted by its
            # max (over keys and sink): the module's own sink logit undoes the shift.
            raw = sink_logits[layer].view(1, -1, 1).numpy()  # (1, H, 1)
            shift = raw - scores[..., -1]  # (B, H, T)
            scores, sinks = scores[..., :-1] + shift[..., None], scores[..., -1] + shift
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
                    sink = None if sinks is None else float(sinks[b, h, q])
                    for k_, v in _row_stats(scores[b, h, q, keys], True, sink).items():
                        acc.setdefault(k_, []).append(v)
            ref.update(_site_reference(("attn", layer, h), acc))
    return ref


def _site_reference(site: tuple, acc: dict[str, list[float]]) -> dict:
    """Row means of one site's rows, its largest logit, and its quantiles over rows (exact
    inverted-CDF quantiles; the histogram's must lie within one bin of them: a third entry is
    the tolerance)."""
    ref = {(*site, k): (float(np.mean(v)), len(v)) for k, v in acc.items()}
    top = acc[vocab.LOGIT_ROW_MAX]
    ref[(*site, vocab.LOGIT_MAX)] = (float(np.max(top)), len(top))
    for name in vocab.QUANTILE_OF:
        lo, hi = vocab.HIST_RANGE[name]
        width = (hi - lo) / vocab.HIST_BINS
        for q in vocab.QUANTILES:
            exact = float(np.quantile(acc[name], q, method="inverted_cdf"))
            ref[(*site, vocab.quantile_metric(name, q))] = (exact, len(acc[name]), width + 1e-9)
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
    return _site_reference(("lm_head", -1, -1), acc)


def _probe(model, ids, mask, backend="auto"):
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    with attach(model, ProbeConfig(dtype="float64", chunk=5, backend=backend)) as probe:
        with torch.no_grad():
            probed = model(input_ids=ids, attention_mask=mask).logits
        df = probe.to_frame()
    # The model's own attention path produced the output: identical, not merely close (eager
    # float64 in transformers turns padded sequences into NaN: NaN must stay NaN).
    torch.testing.assert_close(probed, plain, rtol=0, atol=0, equal_nan=True)
    got = {(r.site_kind, r.layer, r.head, r.metric): (r.value, r.n_rows) for r in df.itertuples()}
    return got, probed


def _assert_match(got: dict, ref: dict) -> None:
    for key, (value, n, *tol) in ref.items():
        gv, gn = got[key]
        assert gn == n, key
        if tol:  # a histogram quantile: within one bin
            assert abs(gv - value) <= tol[0], (key, gv, value)
        else:
            assert gv == pytest.approx(value, rel=REL, abs=1e-12), key


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_statistics_match_eager_reference(arch):
    """Probing a model whose attention is eager: every attention site of every layer, to 1e-9.

    (The LM head is checked on the default path below: eager float64 with padding gives NaN.)"""
    ids, mask = left_padded_batch()
    got, _ = _probe(tiny_model(arch, attn="eager"), ids, mask)
    ref = _reference_attention(arch, ids, mask)
    # the query-key geometry has its own all-pairs reference (test_geometry.py)
    assert {k for k in got if k[0] == "attn" and k[3] not in vocab.GEOMETRY_METRICS} == set(ref)
    assert {k[1] for k in got if k[0] == "attn"} == set(range(tiny_config(arch).num_hidden_layers))
    _assert_match(got, ref)
    # Not trivial: some head is far from uniform; the sinks take real probability.
    assert max(v for k, (v, _) in got.items() if k[0] == "attn" and k[3] == "logit_std") > 0.5
    sink = [v for k, (v, _) in got.items() if k[3] == vocab.SINK_PROB]
    assert (max(sink) > 0.1) if arch == "gpt_oss" else not sink


@pytest.mark.parametrize("arch", ALL_ARCHS)
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


@pytest.mark.parametrize("arch", ["gpt_neox", "llama_gqa", "mistral_sliding", "gemma2_softcap", "gpt_oss"])
def test_fused_path_matches_eager_attention_in_float32(arch):
    """ProbeConfig(fused=True): every attention output comes from the probe's own scores. In
    float32 the logits of real tokens stay within 1e-6 of eager attention's, and the statistics
    within float32 rounding of the default path's."""
    ids, mask = left_padded_batch()
    model = tiny_model(arch, attn="eager").float()
    frames = {}
    for fused in (False, True):
        with attach(model, ProbeConfig(fused=fused)) as probe:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            frames[fused] = probe.to_frame()
        if not fused:
            with torch.no_grad():
                plain = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits, plain, rtol=0, atol=0)
    real = mask.bool()
    torch.testing.assert_close(logits[real], plain[real], rtol=1e-6, atol=1e-6)
    a, b = frames[False], frames[True]
    assert a[["site_kind", "layer", "head", "metric", "n_rows"]].equals(
        b[["site_kind", "layer", "head", "metric", "n_rows"]]
    )
    smooth = ~a.metric.str.contains("peaked")  # a flag may flip on a float32 tie
    np.testing.assert_allclose(b.value[smooth], a.value[smooth], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_unpadded_default_path_matches_eager_reference(arch):
    """No padding: sdpa gets no mask tensor and the probe takes its structured path (key
    ranges by index, batched diagonal blocks); the first layer (identical inputs to the eager
    reference) matches to 1e-9, every head."""
    ids, mask = left_padded_batch(batch=2, pads=(0, 0))
    got, _ = _probe(tiny_model(arch), ids, mask)
    ref = _reference_attention(arch, ids, mask)
    _assert_match(got, {k: v for k, v in ref.items() if k[1] == 0})
