"""Growth and loss-law fits against planted truths, brute-force optima and coverage."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import minimize

from peakprobe import vocab
from peakprobe.fits import FitError, fit_loss_law, fit_power_law, fit_power_law_many

THIRD = 1.0 / 3.0
ALPHAS = [0.2, THIRD, 0.5]


def huber_sum(r: np.ndarray, delta: float = 1e-3) -> float:
    a = np.abs(r)
    return float(np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta)).sum())


def brute_force_min(fun, starts) -> np.ndarray:
    """Best Nelder-Mead optimum over several starts (an optimizer independent of the fits)."""
    best = None
    for s in starts:
        res = minimize(fun, np.asarray(s, dtype=float), method="Nelder-Mead",
                       options={"xatol": 1e-12, "fatol": 1e-16, "maxiter": 40000,
                                "maxfev": 40000})
        if best is None or res.fun < best.fun:
            best = res
    return best.x


# ---------------------------------------------------------------- growth: m = c t^alpha


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", [10, 20, 40])
def test_power_law_recovers_exponent_without_noise(alpha: float, n: int) -> None:
    t = np.logspace(1, 4, n)
    fit = fit_power_law(t, 3.0 * t**alpha, n_boot=100)
    assert abs(fit.alpha - alpha) < 0.01
    assert abs(fit.c - 3.0) < 1e-6
    assert fit.alpha_lo <= alpha + 1e-9 and alpha - 1e-9 <= fit.alpha_hi
    assert fit.r2 > 1 - 1e-12 and fit.n_points == n and fit.monotone
    assert (fit.t_min, fit.t_max) == (10.0, 10000.0)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_power_law_with_noise_is_close_to_truth(alpha: float) -> None:
    rng = np.random.default_rng(int(alpha * 1000))
    t = np.logspace(1, 4, 40)
    fit = fit_power_law(t, 3.0 * t**alpha * (1 + 0.05 * rng.standard_normal(40)))
    # 5% noise over three decades: the slope's sd is about 0.006; allow 6 sd
    assert abs(fit.alpha - alpha) < 0.04
    assert fit.alpha_lo < fit.alpha < fit.alpha_hi


def test_power_law_point_estimate_is_the_huber_optimum() -> None:
    rng = np.random.default_rng(7)
    t = np.logspace(1, 4, 30)
    x = np.log(t)
    for _ in range(3):
        y = np.log(2.0 * t**THIRD * (1 + 0.03 * rng.standard_normal(30)))
        fit = fit_power_law(t, np.exp(y), n_boot=0)

        def obj(p, y=y):
            return huber_sum(y - p[0] - p[1] * x)

        ref = brute_force_min(obj, [[0.0, 0.0], [1.0, 0.5], [np.log(2.0), THIRD]])
        ours = np.array([np.log(fit.c), fit.alpha])
        assert obj(ours) <= obj(ref) + 1e-12
        assert np.allclose(ours, ref, atol=1e-6)


def test_many_series_recover_their_own_exponents() -> None:
    t = np.linspace(2000, 143000, 142)
    alphas = np.array([0.0, 0.1, THIRD, 0.5, -0.2])
    fits = fit_power_law_many(t, 1.5 * t[None, :] ** alphas[:, None], n_boot=50)
    assert np.allclose([f.alpha for f in fits], alphas, atol=1e-9)
    assert ["flat" in f.flags for f in fits] == [True, False, False, False, False]


@pytest.mark.parametrize(("alpha", "noise", "stream"), [(0.2, 0.05, 1), (THIRD, 0.02, 2),
                                                         (0.5, 0.01, 3)])
def test_power_law_interval_coverage(alpha: float, noise: float, stream: int) -> None:
    """200 seeded replicates of 30 noisy points: the 90% interval must hold the truth 85-95%."""
    rng = np.random.default_rng(1000 + stream)
    t = np.logspace(1, 4, 30)
    hits = 0
    for k in range(200):
        y = 3.0 * t**alpha * (1 + noise * rng.standard_normal(30))
        fit = fit_power_law(t, y, seed=k)
        hits += fit.alpha_lo <= alpha <= fit.alpha_hi
    assert 0.85 <= hits / 200 <= 0.95


def test_power_law_flags_a_late_drop_and_still_fits() -> None:
    t = np.logspace(1, 4, 30)
    y = t**THIRD
    y[-6:] = y[-7] * np.linspace(0.95, 0.7, 6)  # the metric falls back by 30% at the end
    fit = fit_power_law(t, y, n_boot=200)
    assert not fit.monotone
    assert "non_monotone" in fit.flags and "late_drop" in fit.flags
    assert np.isfinite([fit.alpha, fit.alpha_lo, fit.alpha_hi]).all()
    assert 0.2 < fit.alpha < THIRD + 0.01  # the Huber line follows the bulk of the points


def test_power_law_monotone_noisy_curve_is_not_flagged() -> None:
    rng = np.random.default_rng(3)
    t = np.logspace(1, 4, 30)
    fit = fit_power_law(t, t**THIRD * (1 + 0.01 * rng.standard_normal(30)), n_boot=50)
    assert fit.monotone and fit.flags == ()


def test_power_law_too_few_points_is_a_clear_error() -> None:
    with pytest.raises(FitError, match="at least 4 points"):
        fit_power_law([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    with pytest.raises(FitError, match="at least 4 points"):
        fit_power_law([0.0, 1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 0.0, np.nan, 2.0])
    with pytest.raises(FitError, match="two distinct times"):
        fit_power_law([5.0] * 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    with pytest.raises(ValueError, match="ci must be"):
        fit_power_law(np.arange(1.0, 10.0), np.arange(1.0, 10.0), ci=90)


def test_power_law_drops_unusable_points_and_says_so() -> None:
    t = np.array([0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0])
    y = 2.0 * np.maximum(t, 1.0) ** 0.5
    y[3] = np.nan
    fit = fit_power_law(t, y, n_boot=20)
    assert "dropped_points" in fit.flags and fit.n_points == 6
    assert abs(fit.alpha - 0.5) < 1e-9 and fit.t_min == 10.0


# ---------------------------------------------------------------- loss: L = L0 + c t^-alpha


def loss_curve(t: np.ndarray, alpha: float, L0: float = 2.0) -> np.ndarray:
    """A loss whose reducible part is L0 / 4 at the last point."""
    return L0 + 0.25 * L0 * t.max() ** alpha * t**-alpha


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", [10, 25, 40])
def test_loss_law_recovers_parameters_without_noise(alpha: float, n: int) -> None:
    t = np.logspace(1, 4, n)
    fit = fit_loss_law(t, loss_curve(t, alpha), n_boot=50)
    assert abs(fit.alpha - alpha) < 0.01
    assert abs(fit.L0 - 2.0) < 1e-4
    assert abs(fit.c - 0.5 * 1e4**alpha) / (0.5 * 1e4**alpha) < 1e-4
    assert fit.monotone and fit.n_points == n
    assert fit.third_in_ci == (abs(alpha - THIRD) < 1e-6)


def test_loss_law_point_estimate_is_the_huber_optimum() -> None:
    rng = np.random.default_rng(11)
    t = np.logspace(1, 4, 30)
    lt = np.log(t)
    for _ in range(3):
        y = np.log(loss_curve(t, THIRD) * (1 + 0.01 * rng.standard_normal(30)))
        fit = fit_loss_law(t, np.exp(y), n_boot=0)
        lmin = float(np.exp(y).min())

        def obj(p, y=y, lmin=lmin):  # p = (L0, log c, alpha); bounds by rejection
            if not 0.0 <= p[0] <= lmin or p[2] < 0:
                return 1e9
            return huber_sum(y - np.log(p[0] + np.exp(p[1] - p[2] * lt)))

        starts = [[l0, np.log(c), a] for l0 in (0.5, 1.5, 1.9) for c in (3.0, 10.0)
                  for a in (0.2, 0.4)]
        ref = brute_force_min(obj, starts)
        ours = np.array([fit.L0, np.log(fit.c), fit.alpha])
        assert obj(ours) <= obj(ref) + 1e-10
        assert abs(fit.alpha - ref[2]) < 1e-4 and abs(fit.L0 - ref[0]) < 1e-4


def test_loss_law_interval_coverage() -> None:
    """Seeded replicates of 30 points with 2% noise: the 90% intervals of alpha and L0 must
    hold the truth 85-95% of the time. 400 replicates (the issue asks for at least 200) keep
    the binomial spread (+-1.5%) well inside that band."""
    rng = np.random.default_rng(2024)
    t = np.logspace(1, 4, 30)
    reps = 400
    hits_alpha = hits_l0 = 0
    for k in range(reps):
        L = loss_curve(t, THIRD) * (1 + 0.02 * rng.standard_normal(30))
        fit = fit_loss_law(t, L, seed=k)
        hits_alpha += fit.alpha_lo <= THIRD <= fit.alpha_hi
        hits_l0 += fit.L0_lo <= 2.0 <= fit.L0_hi
    assert 0.85 <= hits_alpha / reps <= 0.95
    assert 0.85 <= hits_l0 / reps <= 0.95


@pytest.mark.slow
@pytest.mark.parametrize(("alpha", "noise"), [(0.2, 0.02), (0.5, 0.02), (THIRD, 0.05),
                                              (0.5, 0.05)])
def test_loss_law_interval_coverage_more_regimes(alpha: float, noise: float) -> None:
    rng = np.random.default_rng(77)
    t = np.logspace(1, 4, 30)
    hits = 0
    for k in range(200):
        fit = fit_loss_law(t, loss_curve(t, alpha) * (1 + noise * rng.standard_normal(30)),
                           seed=k)
        hits += fit.alpha_lo <= alpha <= fit.alpha_hi
    assert 0.85 <= hits / 200 <= 0.95


def test_loss_law_one_third_verdict_and_distance() -> None:
    rng = np.random.default_rng(5)
    t = np.logspace(1, 4, 30)
    for alpha in (THIRD, 0.7):
        fit = fit_loss_law(t, loss_curve(t, alpha) * (1 + 0.005 * rng.standard_normal(30)))
        half = (fit.alpha_hi - fit.alpha) if THIRD >= fit.alpha else (fit.alpha - fit.alpha_lo)
        assert fit.third_in_ci == (fit.alpha_lo <= THIRD <= fit.alpha_hi)
        assert fit.third_distance_ci == pytest.approx(abs(THIRD - fit.alpha) / half)
        assert fit.third_in_ci == (alpha == THIRD)
    assert fit.third_distance_ci > 1.0


def test_loss_law_flags_a_late_rise_and_still_fits() -> None:
    """Like Pythia-70m's LAMBADA curve: the loss falls, then rises again at the end."""
    t = np.logspace(1, 4, 30)
    L = loss_curve(t, THIRD)
    L[-6:] = L[-7] * np.linspace(1.02, 1.12, 6)  # up by 12% over the last six checkpoints
    fit = fit_loss_law(t, L, n_boot=200)
    assert not fit.monotone
    assert "non_monotone" in fit.flags and "late_rise" in fit.flags
    assert np.isfinite([fit.alpha, fit.alpha_lo, fit.alpha_hi, fit.L0]).all()
    assert 0.0 <= fit.L0 <= L.min()


def test_loss_law_too_few_points_is_a_clear_error() -> None:
    with pytest.raises(FitError, match="at least 5 checkpoints"):
        fit_loss_law([10.0, 20.0, 40.0, 80.0], [3.0, 2.8, 2.6, 2.5])
    with pytest.raises(FitError, match="same length"):
        fit_loss_law([10.0, 20.0, 40.0, 80.0, 160.0], [3.0, 2.8])


# ---------------------------------------------------------------- three-way verdicts on planted curves


@pytest.mark.parametrize(("law", "alpha", "n", "span", "noise", "want"), [
    ("loss", THIRD, 30, (1, 4), 0.002, "consistent"),
    ("loss", 0.7, 30, (1, 4), 0.002, "inconsistent"),
    ("loss", THIRD, 8, (1.25, 2.65), 0.02, "inconclusive"),  # tau 18-439, a loose interval
    ("growth", THIRD, 30, (1, 4), 0.01, "consistent"),
    ("growth", 0.6, 30, (1, 4), 0.01, "inconsistent"),
    ("growth", THIRD, 6, (1, 1.5), 0.05, "inconclusive"),
])
def test_three_way_verdict_on_planted_curves(law, alpha, n, span, noise, want) -> None:
    from peakprobe.fits import judge_third

    rng = np.random.default_rng(42)
    t = np.logspace(*span, n)
    eps = 1 + noise * rng.standard_normal(n)
    if law == "loss":
        fit = fit_loss_law(t, loss_curve(t, alpha) * eps, seed=1)
    else:
        fit = fit_power_law(t, 3.0 * t**alpha * eps, seed=1)
    assert judge_third(fit.alpha_lo, fit.alpha_hi) == want, (fit.alpha_lo, fit.alpha_hi)
    if want == "inconclusive":  # 1/3 inside an interval wider than the band: never consistent
        assert fit.alpha_lo <= THIRD <= fit.alpha_hi and fit.alpha_hi - fit.alpha_lo > 0.17


def test_top_sites_rank_an_uninformative_share_interval_last() -> None:
    """Significant first, then sites whose share interval is bounded by L - L0, then the rest:
    a large point share with an interval spanning everything does not lead the list."""
    from peakprobe.fits.classify import top_sites

    def site(head, share, lo, hi, q):
        return {"site_kind": vocab.ATTN, "layer": 0, "head": head, "label": f"attn L0 H{head}",
                "peaked": True, "site_class": "concentrating", "gain_verdict": "inconclusive",
                "share": share, "share_lo": lo, "share_hi": hi, "q_share": q,
                "alpha_gain": 0.3, "alpha_late": 0.3, "sensitivity": -0.1}

    sites = pd.DataFrame([
        site(0, 0.16, 0.0, 1e4, 1.0),  # extrapolated through few points: says nothing
        site(1, 0.01, 0.0, 0.67, 1.0),
        site(2, 0.30, 0.2, 0.4, 0.01),  # significant
        site(3, 0.05, 0.0, float("nan"), 1.0),  # no interval at all
        site(4, 0.02, 0.0, 0.05, 1.0),
    ])
    assert [s["head"] for s in top_sites(sites)] == [2, 4, 1, 0, 3]


def test_top_site_share_intervals_are_printed_and_an_unbounded_end_is_named() -> None:
    from peakprobe.fits.text import _pct_ci

    assert _pct_ci(0.0, 0.67) == "[0%, 67%]"
    assert _pct_ci(0.3, 3.65) == "[30%, 365%]"
    assert _pct_ci(0.0, 9.5e3) == "[0%, >1000%]"
    assert _pct_ci(None, float("nan")) == "[n/a, n/a]"


def test_drop_share_reads_the_laws_difference_and_is_undefined_without_a_decrease():
    """(G(t1) - G(t2)) / (L(t1) - L(t2)) from the fitted laws: with G = a t^-alpha and
    L = L0 + c t^-alpha the share is a / c whatever L0; a loss law that does not fall gives NaN."""
    from types import SimpleNamespace

    from peakprobe.fits.classify import drop_share

    got = drop_share({"alpha": 0.4, "c": 0.3}, None, SimpleNamespace(c=1.2, alpha=0.4, L0=5.0), None, 2.0, 50.0)
    assert got["share"] == pytest.approx(0.25, rel=1e-12)
    flat = drop_share({"alpha": 0.4, "c": 0.3}, None, SimpleNamespace(c=0.02, alpha=0.0, L0=4.1), None, 0.25, 4.2)
    assert math.isnan(flat["share"]) and math.isnan(flat["share_lo"])


def test_robust_p_value_is_not_inflated_by_a_ratios_few_huge_draws():
    """Normal bootstrap samples give the same p either way; a few huge draws (a ratio whose
    denominator came near 0) inflate the standard error but not the interquartile scale."""
    from peakprobe.fits.common import p_at_most

    rng = np.random.default_rng(0)
    clean = rng.normal(1.0, 0.3, 4000)
    plain, robust = (float(p_at_most(np.array([1.0]), clean[None, :], 0.1, robust=r)[0]) for r in (False, True))
    assert robust == pytest.approx(plain, rel=0.15) and plain < 0.005
    spiky = clean.copy()
    spiky[:40] = 60.0  # 1% of the draws
    plain = float(p_at_most(np.array([1.0]), spiky[None, :], 0.1)[0])
    robust = float(p_at_most(np.array([1.0]), spiky[None, :], 0.1, robust=True)[0])
    assert plain > 0.05 > 0.005 > robust
