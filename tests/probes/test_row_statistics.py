"""The probes on their own: closed forms for single rows, exact merging of accumulators, the
entropy-equivalent beta_eff (authors' anchor, a fresh Monte Carlo), sink-excluded and
learned-sink statistics, and the causal path with a query offset against float64 rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peakprobe import vocab
from peakprobe.probes import (
    Accumulator,
    MaskSpec,
    SiteGroup,
    attention_forward_with_sums,
    attention_head_sums,
    beta_eff,
    expected_entropy,
    row_stats,
)
from peakprobe.probes._entropy_curve import B_GRID
from peakprobe.probes.gaussian_entropy import counts, peaked_threshold
from peakprobe.probes.rows import block_sums, finish, top2
from peakprobe.probes.sums import merge, merge_one, single
from peakprobe.probes.workspace import Workspace


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


# -- entropy-equivalent peakedness -------------------------------------------------------------


def test_beta_eff_meets_the_authors_anchor_and_its_threshold():
    """The authors: at n = 32000 an entropy of 1.69 nats is Gaussian logits of std 6.87, above
    sqrt(2 ln n) = 4.55. Our tabulated expectation puts it 1.5% lower (see docs/probes.md)."""
    b = beta_eff(torch.tensor([1.69], dtype=torch.float64), torch.tensor([32000.0]))
    assert b.item() == pytest.approx(6.87, rel=0.02)
    assert b.item() > peaked_threshold(32000) == pytest.approx(4.55, abs=0.01)


@pytest.mark.parametrize("n, ratio", [(7, 0.6), (100, 1.3), (4096, 1.1)])
def test_tabulated_entropy_matches_a_fresh_monte_carlo(n, ratio):
    """Independent check of the table: brute-force E[H] of softmax(beta x), new seed and
    sample count, within 4 standard errors (n = 4096 is above the exact-sampling range)."""
    beta = ratio * math.sqrt(2 * math.log(n))
    g = torch.Generator().manual_seed(123)
    x = torch.randn(max(400, (1 << 20) // n), n, generator=g, dtype=torch.float64) * beta
    p = torch.softmax(x, -1)
    h = -(torch.special.xlogy(p, p)).sum(-1)
    se = h.std().item() / math.sqrt(h.numel())
    got = expected_entropy(torch.tensor(beta), torch.tensor(float(n))).item()
    assert abs(got - h.mean().item()) < 4 * se + 2e-3 * math.log(n)


def test_beta_eff_inverts_the_curve_and_clamps_outside_it():
    n = torch.tensor([2.0, 50.0, 3000.0, 1e6])  # 1e6 is beyond the table's largest n
    beta = torch.tensor([0.7, 2.5, 9.0, 4.0], dtype=torch.float64)
    assert torch.allclose(beta_eff(expected_entropy(beta, n), n), beta, rtol=1e-12)
    assert beta_eff(n.log(), n).tolist() == [0.0] * 4  # uniform: beta 0
    assert beta_eff(n.log() + 1, n).tolist() == [0.0] * 4
    top = peaked_threshold(n.double()) * B_GRID[-1]
    assert torch.allclose(beta_eff(torch.zeros(4), n), top)  # entropy 0: the last knot
    h = torch.linspace(0, math.log(50), 200, dtype=torch.float64)
    assert (beta_eff(h, torch.full_like(h, 50.0)).diff() <= 0).all()  # falls with entropy


def test_beta_eff_matches_a_dense_inversion_of_each_rows_curve():
    """The bracketed search against counting over every knot of the row's own curve (the
    curve from ``expected_entropy`` at the knots), for random n and h, and h exactly at knots."""
    g = torch.Generator().manual_seed(3)
    n = torch.cat([torch.tensor([2.0, 3.0, 4.0, 6.0, 1024.0, 2.0**18, 5e5]),
                   (torch.rand(3000, generator=g, dtype=torch.float64) * math.log(4e5)).exp().round().clamp(min=2)])
    knots = torch.tensor(B_GRID, dtype=torch.float64)
    thr = peaked_threshold(n)
    curve = torch.stack([expected_entropy(b * thr, n) / n.log() for b in knots], -1)  # (R, Nb)
    at_knot = curve.gather(-1, torch.randint(0, len(B_GRID), (len(n), 1), generator=g)).squeeze(-1)
    h = torch.where(torch.rand(len(n), generator=g) < 0.3, at_knot, torch.rand(len(n), generator=g, dtype=torch.float64))
    got = beta_eff(h * n.log(), n)
    j = ((curve >= h.unsqueeze(-1)).sum(-1) - 1).clamp(0, len(B_GRID) - 2)  # last knot >= h
    c0, c1 = curve.gather(-1, j.unsqueeze(-1)).squeeze(-1), curve.gather(-1, (j + 1).unsqueeze(-1)).squeeze(-1)
    t = ((c0 - h) / (c0 - c1)).clamp(0, 1)
    want = torch.where(h >= 1, torch.zeros_like(h), (knots[j] + (knots[j + 1] - knots[j]) * t) * thr)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_max", [1024, 3000])
def test_beta_eff_from_per_n_tables_matches_the_general_path(n_max):
    """The tabled search (``counts`` with a bound, branch-free steps over padded curves) against
    the bracketed binary search of every row's own curve: random whole n up to the bound
    (n = 0 and 1 included, and a broadcast (1, N) count), h at knots, above 1, at 0, NaN."""
    g = torch.Generator().manual_seed(11)
    n = torch.cat([torch.tensor([0.0, 1.0, 2.0, 3.0, float(n_max)]),
                   torch.randint(2, n_max + 1, (4000,), generator=g).double()])
    knots = torch.tensor(B_GRID, dtype=torch.float64)
    thr = peaked_threshold(n.clamp(min=2))
    curve = torch.stack([expected_entropy(b * thr, n.clamp(min=2)) / n.clamp(min=2).log() for b in knots], -1)
    at_knot = curve.gather(-1, torch.randint(0, len(B_GRID), (len(n), 1), generator=g)).squeeze(-1)
    h = torch.where(torch.rand(len(n), generator=g) < 0.3, at_knot, torch.rand(len(n), generator=g, dtype=torch.float64))
    h[:8] = torch.tensor([0.0, 1.0, 1.5, 0.0, 0.5, 1.0, 1e-9, 0.999999])
    h[9] = float("nan")
    entropy = h * n.clamp(min=2).log()
    tabled = counts(n, n_max)
    assert tabled.tables is not None
    got = beta_eff(entropy, tabled)
    want = beta_eff(entropy, n)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    # no bound: the general path itself
    torch.testing.assert_close(beta_eff(entropy, counts(n, None)), want, rtol=0, atol=0, equal_nan=True)
    small = counts(n[None, :50], n_max)  # a broadcast count, one row of entropies per head
    torch.testing.assert_close(beta_eff(entropy[:50].expand(3, 50), small), want[:50].expand(3, 50),
                               rtol=1e-12, atol=1e-12, equal_nan=True)


def test_merge_one_is_merge_with_a_single_option_bit_for_bit():
    """Rows with options, empty rows and an absent single option (finite logits)."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 64, 16, generator=g, dtype=torch.float64) * 4
    valid = torch.rand(4, 64, 16, generator=g) < 0.7
    valid[0] = False  # empty parts
    x = block_sums(z, valid)
    one = torch.randn(64, generator=g, dtype=torch.float64) * 4
    present = torch.rand(64, generator=g) < 0.8
    for p in (None, present):
        want, got = merge(x, single(one.expand(4, 64), p)), merge_one(x, one.expand(4, 64), p)
        for f in want.__dataclass_fields__:
            torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=0, atol=0, equal_nan=True)


def test_sink_excluded_statistics_of_a_parked_row():
    """Key 0 takes nearly all the mass; the rest is uniform: the _xsink statistics see a
    uniform row over n - 1 keys (entropy log 3, max_prob 1/3, std 0, not peaked)."""
    z = torch.tensor([[40.0, 1.0, 1.0, 1.0], [5.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, True], [False, True, True, False]])
    v = row_stats(z, valid, first_key=True)
    x = {name: v.values[name + vocab.XSINK_SUFFIX] for name in ("entropy", "max_prob", "logit_std", "peaked")}
    assert v.values["max_prob"][0] > 0.999 and v.values["peaked"][0] == 1.0
    assert x["entropy"][0] == pytest.approx(math.log(3)) and x["max_prob"][0] == pytest.approx(1 / 3)
    assert x["logit_std"][0] == 0.0 and x["peaked"][0] == 0.0
    assert v.values[vocab.PEAKED_ENTROPY + vocab.XSINK_SUFFIX][0] == 0.0
    # Row 1 has two visible keys: one is left once key 1 (its first) is out, so it is skipped.
    assert v.weight["entropy" + vocab.XSINK_SUFFIX].tolist() == [1.0, 0.0]
    assert v.values["first_key_prob"][1] == pytest.approx(1 / (1 + math.exp(-2)))


def test_a_learned_sink_is_one_more_option_of_the_softmax_only():
    """finish with a sink logit: probabilities over n + 1 options, logit statistics over n."""
    z = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    sink = torch.tensor([2.5], dtype=torch.float64)
    keys = block_sums(z)
    s = finish(keys, torch.ones(1, dtype=torch.bool), first=z[:, 0], sink=sink).values
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0, 2.5], dtype=torch.float64), 0)
    assert s[vocab.SINK_PROB][0] == pytest.approx(p[3].item())
    assert s["first_key_prob"][0] == pytest.approx(p[0].item())
    assert s["entropy"][0] == pytest.approx(-(p * p.log()).sum().item())
    assert s["entropy_norm"][0] == pytest.approx(s["entropy"][0].item() / math.log(4))
    assert s["max_prob"][0] == pytest.approx(p.max().item())
    assert s["logit_std"][0] == pytest.approx(z.std(unbiased=False).item())
    assert s["logit_top_gap"][0] == pytest.approx(1.0)


def test_top2_matches_topk_with_ties():
    g = torch.Generator().manual_seed(0)
    for n in (2, 5, 63, 64, 100, 1000):
        x = (torch.randn(40, n, generator=g) * 3).round()  # many ties
        m, m2 = top2(x)
        ref = x.topk(2, -1).values
        assert torch.equal(m, ref[:, 0]) and torch.equal(m2, ref[:, 1]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_sums_match_their_definitions_with_ties_hidden_options_and_a_workspace(dtype):
    """Every raw sum of ``block_sums`` against its definition written out in float64, with
    many tied maxima (a tie counts twice, as ``topk`` does), hidden options, rows with one or
    no visible option, and the same workspace reused by blocks of other shapes."""
    g = torch.Generator().manual_seed(1)
    work = Workspace()
    for rows, n in ((50, 64), (30, 7), (40, 100)):
        x = (torch.randn(rows, n, generator=g) * 2).round().to(dtype)  # many ties
        x[0] = 3.0  # every option tied
        for valid in (None, torch.rand(rows, n, generator=g) > 0.4):
            if valid is not None:
                valid[1] = False
                valid[2] = False
                valid[2, 5] = True
            got = block_sums(x, valid, work=work)
            vis = torch.ones(rows, n, dtype=torch.bool) if valid is None else valid
            ref = x.to(torch.float64).masked_fill(~vis, float("-inf"))
            cnt = vis.sum(-1)
            top = ref.topk(2, -1).values
            assert torch.equal(got.n, cnt.to(torch.float64))
            has, two = cnt > 0, cnt > 1
            assert torch.equal(got.m[has], top[has, 0]) and torch.equal(got.m2[two], top[two, 1])
            d = torch.where(vis, ref - top[:, :1], 0.0)
            e = torch.where(vis, d.exp(), 0.0)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.s[has], e.sum(-1)[has], **tol)
            torch.testing.assert_close(got.a[has], (e * d).sum(-1)[has], **tol)
            torch.testing.assert_close(got.d1[has], d.sum(-1)[has], **tol)
            torch.testing.assert_close(got.d2[has], (d * d).sum(-1)[has], **tol)


def _eager(q, k, v, visible, sinks=None):
    """float64 softmax attention written out: q (B, H, Tq, D), k/v (B, Hkv, Tk, D)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    z = (q @ k.transpose(-1, -2)) * 0.3
    z = z.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        z = torch.cat([z, sinks.view(1, -1, 1, 1).expand(*z.shape[:-1], 1)], -1)
    p = torch.softmax(z, -1)[..., : k.shape[2]]
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("tq, off, chunk", [(37, 0, 8), (30, 5, 7), (16, 0, 16)])
def test_structured_and_masked_paths_agree_and_fused_output_is_attention(tq, off, chunk):
    """Causal structure by index (key ranges, batched diagonal) and the same structure as a
    bool mask give the same statistics; the fused output is softmax attention; the statistics
    alone (each chunk's diagonal masked in its own block) agree to rounding."""
    g = torch.Generator().manual_seed(tq)
    q = torch.randn(2, 4, tq, 8, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, 2, tq + off, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 2, tq + off, 8, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.0, 3.0, -1.0, 8.0], dtype=torch.float64)
    visible = torch.arange(tq + off).view(1, -1) <= torch.arange(tq).view(-1, 1) + off
    kw = dict(scaling=0.3, chunk=chunk, dtype=torch.float64, sinks=sinks)
    by_index = attention_forward_with_sums(q, k, v, mask=MaskSpec(q_offset=off), **kw)
    by_mask = attention_forward_with_sums(
        q, k, v, mask=MaskSpec(mask=visible.view(1, 1, tq, -1), q_offset=off), **kw
    )
    assert by_index[1].names == by_mask[1].names
    torch.testing.assert_close(by_index[1].sums, by_mask[1].sums, rtol=1e-12, atol=1e-12)
    assert torch.equal(by_index[1].counts, by_mask[1].counts)
    torch.testing.assert_close(by_index[1].maxima, by_mask[1].maxima, rtol=1e-12, atol=1e-12)
    ref = _eager(q, k, v, visible, sinks)
    for out in (by_index[0], by_mask[0]):
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    plain = attention_head_sums(q, k, mask=MaskSpec(q_offset=off), **kw)
    torch.testing.assert_close(plain.sums, by_index[1].sums, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tq, off, tk, chunk", [
    (30, 5, 35, 7),  # ragged chunks: the inline corner starts mid-chunk
    (32, 3, 35, 8),  # chunk ends aligned to the offset
    (24, 9, 33, 32),  # one chunk holds every row
    (20, 6, 23, 4),  # fewer keys than queries + offset: the last rows' corner is cut short
])
def test_causal_statistics_with_a_query_offset_match_a_float64_reference(tq, off, tk, chunk):
    """The default causal path with queries starting ``off`` positions into the keys (a KV
    cache): every statistic's per-head mean against each row written out in numpy float64
    (row q sees keys 0..min(q + off, tk - 1))."""
    from helpers.reference import _row_stats

    g = torch.Generator().manual_seed(tq * 100 + tk)
    q = torch.randn(2, 2, tq, 8, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, 1, tk, 8, generator=g, dtype=torch.float64) * 2
    site = attention_head_sums(q, k, scaling=0.4, mask=MaskSpec(q_offset=off), chunk=chunk,
                               dtype=torch.float64)
    names, sums, cnt = site.names, site.sums, site.counts
    z = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.4).numpy()  # (B, H, Tq, Tk)
    checked = set()
    for h in range(2):
        rows: dict[str, list[float]] = {}
        for b in range(2):
            for i in range(tq):
                for name, value in _row_stats(z[b, h, i, : min(i + off, tk - 1) + 1], True).items():
                    rows.setdefault(name, []).append(value)
        for name, values in rows.items():
            j = names.index(name)
            assert cnt[h, j] == len(values), name
            torch.testing.assert_close(float(sums[h, j] / cnt[h, j]), float(np.mean(values)),
                                       rtol=1e-9, atol=1e-9, msg=name)
            checked.add(name)
    assert len(checked) >= 15, sorted(checked)
