"""The weight figure qk_spectral_norm (scaling * ||W_Q,h^T W_K,h||_2 per head) against W_Q,h and
W_K,h recovered by least squares from the model's own queries and keys (no layout knowledge),
on every tiny architecture; against the projection weights directly where q and k are
normalised; the QR shortcut against a dense SVD; layouts that cannot be read give no rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import left_padded_batch
from helpers.qk_reference import (
    EXTRA_ARCHS,
    QK_NORMED,
    qk_model,
    recovered_spectral_norms,
    weight_spectral_norms,
)
from helpers.reference import ALL_ARCHS

from peakprobe import vocab
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach
from peakprobe.hooks.engine import qk_spectral_part
from peakprobe.hooks.qk_weights import qk_weights
from peakprobe.probes.geometry import qk_spectral_norms


def _probed(model) -> dict[int, np.ndarray]:
    """layer -> (H,) qk_spectral_norm of one probe of ``model`` (every head has one row, n_rows 1)."""
    ids, mask = left_padded_batch()
    with attach(model, ProbeConfig(dtype="float64")) as probe:
        probe.run_batch(ids, mask)
        frame = probe.to_frame()
    rows = frame[frame["metric"] == vocab.QK_SPECTRAL].sort_values(["layer", "head"])
    assert (rows["site_kind"] == vocab.ATTN).all() and (rows["n_rows"] == 1).all()
    return {int(layer): g["value"].to_numpy() for layer, g in rows.groupby("layer")}


@pytest.mark.parametrize("arch", [a for a in ALL_ARCHS + EXTRA_ARCHS if a not in QK_NORMED])
def test_against_weights_recovered_from_queries_and_keys(arch):
    model = qk_model(arch)
    want = recovered_spectral_norms(model)
    got = _probed(model)
    assert sorted(got) == sorted(want) == [0, 1]
    for layer in want:
        assert got[layer].shape == want[layer].shape
        np.testing.assert_allclose(got[layer], want[layer], rtol=1e-6)
    # not trivial: the heads differ, and grouped-query heads are not all their group's twin
    assert np.ptp(np.concatenate(list(got.values()))) > 1e-3


@pytest.mark.parametrize("arch", QK_NORMED)
def test_qk_normalised_models_read_from_the_projections(arch):
    """OLMo-2 (q/k norm over all heads) and Qwen3 (per head): q and k are not affine in x, so
    the figure is the projections' own (finite), equal to the weights' dense SVD."""
    model = qk_model(arch)
    got, want = _probed(model), weight_spectral_norms(model)
    assert sorted(got) == sorted(want) == [0, 1]
    for layer in want:
        assert np.isfinite(got[layer]).all()
        np.testing.assert_allclose(got[layer], want[layer], rtol=1e-9)
    with pytest.raises(AssertionError, match="not affine"):  # the recovery sees the norm
        recovered_spectral_norms(model)


@pytest.mark.parametrize("shape", [(4, 2, 8, 32), (3, 3, 16, 16), (2, 1, 12, 5)])
def test_qr_shortcut_equals_the_dense_product(shape):
    """(H, Hkv, d, D): the R1 R2^T route equals numpy's SVD of the (D, D) product, GQA
    groups and a model width below the head size included."""
    h, hkv, d, dim = shape
    g = torch.Generator().manual_seed(sum(shape))
    wq = torch.randn(h, d, dim, generator=g, dtype=torch.float64)
    wk = torch.randn(hkv, d, dim, generator=g, dtype=torch.float64)
    got = qk_spectral_norms(wq.float(), wk.float()).numpy()  # float32 weights, float64 figure
    a, b = wq.float().double().numpy(), wk.float().double().numpy()
    want = [np.linalg.svd(a[i].T @ b[i // (h // hkv)], compute_uv=False)[0] for i in range(h)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_unread_layouts_give_no_rows():
    """A fused projection of a class not listed (Falcon's layout differs from GPT-NeoX's), and
    shapes that do not match the call's heads: no figure, no error."""

    class FalconAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value = torch.nn.Linear(32, 96)

    class OddAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(32, 64), torch.nn.Linear(32, 24)

    assert qk_weights(FalconAttention(), 4, 8) is None
    assert qk_weights(OddAttention(), 4, 8) is None  # q_proj holds 2 x (H d): a gated query
    assert qk_weights(OddAttention(), 8, 8) is None  # 3 key groups do not divide 8 heads
    part = qk_spectral_part(FalconAttention(), 4, 8, 0.5)
    assert part.shape == (4, 2) and not part.any()
