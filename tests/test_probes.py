"""The probes on their own: closed forms for single rows, and exact merging of accumulators."""

from __future__ import annotations

import math

import pytest
import torch

from peakprobe.probes import Accumulator, SiteGroup, row_stats


def test_uniform_and_two_level_rows_match_closed_forms():
    z = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    s = row_stats(z, torch.ones(1, 4, dtype=torch.bool), first_key=True,
                  target=torch.tensor([0, 1]))
    v = s.values
    assert v["entropy"][0] == pytest.approx(math.log(4)) and v["entropy_norm"][0] == pytest.approx(1)
    assert v["max_prob"][0] == pytest.approx(0.25) and v["logit_std"][0] == 0.0
    e3 = math.exp(3.0)
    assert v["max_prob"][1] == pytest.approx(e3 / (e3 + 3))
    assert v["logit_std"][1] == pytest.approx(math.sqrt(9 / 4 - (3 / 4) ** 2))
    assert v["logit_max_minus_mean"][1] == pytest.approx(3 - 0.75)
    assert v["logit_top_gap"][1] == pytest.approx(3.0)
    assert v["first_key_prob"][1] == pytest.approx(e3 / (e3 + 3))
    assert v["loss"][1] == pytest.approx(math.log(e3 + 3))
    assert v["target_logit_minus_mean"][1] == pytest.approx(-0.75)
    # sqrt(2 ln 4) = 1.665 > std 1.299: not peaked
    assert v["peaked"].tolist() == [0.0, 0.0]


def test_masked_options_and_single_option_rows():
    z = torch.tensor([[5.0, 1.0, -2.0], [7.0, 9.0, 9.0]], dtype=torch.float64)
    valid = torch.tensor([[False, True, True], [True, False, False]])
    s = row_stats(z, valid, first_key=True)
    assert s.values["logit_std"][0] == pytest.approx(1.5)  # over {1, -2} only
    assert s.values["first_key_prob"][0] == pytest.approx(1 / (1 + math.exp(-3)))
    assert s.weight["entropy_norm"].tolist() == [1.0, 0.0]  # n = 1 rows are skipped
    assert s.weight["logit_top_gap"].tolist() == [1.0, 0.0]
    assert s.weight["max_prob"].tolist() == [1.0, 1.0]


def _random_stats(seed: int):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) * 4  # (B, H, rows, n)
    return row_stats(z, torch.ones(1, 1, 1, 7, dtype=torch.bool))


def test_accumulators_merge_and_round_trip_exactly():
    whole, a, b = Accumulator(), Accumulator(), Accumulator()
    group = SiteGroup("attn", 2)
    for seed in range(4):
        whole.add_rows(group, _random_stats(seed), head_dim=1)
        (a if seed % 2 else b).add_rows(group, _random_stats(seed), head_dim=1)
    a.merge(b)
    restored = Accumulator()
    restored.load_state_dict(a.state_dict())
    for other in (a, restored):
        got, want = other.to_frame(), whole.to_frame()
        assert got["n_rows"].tolist() == want["n_rows"].tolist()
        torch.testing.assert_close(torch.tensor(got["value"].values), torch.tensor(want["value"].values),
                                   rtol=1e-14, atol=1e-14)
    # The mean of a metric equals the plain mean over all rows of all batches.
    rows = torch.cat([_random_stats(s).values["logit_std"][:, 1].reshape(-1) for s in range(4)])
    frame = whole.to_frame()
    head1 = frame[(frame["head"] == 1) & (frame.metric == "logit_std")].iloc[0]
    assert head1["value"] == pytest.approx(rows.mean().item(), rel=1e-13)
    assert head1["n_rows"] == rows.numel()
