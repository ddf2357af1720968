"""Tests of the solvable linear-attention toy (the package peakprobe.toy.linear_attention).

References, all independent of the code under test: torch autograd on the dense linear
self-attention for the sparse SGD step and for the full-batch step on explicit context tokens;
solve_ivp on the full (kappa, q) vector gradient flow and on the scalar mode ODE for the closed
forms; brute-force Monte Carlo of the data for the loss formulas; chi-square moments for the
sampled m; exact sums for the data-law asymptote; a planted scaling form with known exponents for
the compute frontier; and the closed-form exponents a/(1+a), a, a/(2+a), 1/(2+a), 1 for the
quick run of all five laws.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from peakprobe import vocab
from peakprobe.toy import ToyConfigError
from peakprobe.toy.linear_attention.context import context_law, power_law_context
from peakprobe.toy.linear_attention.data import data_law, unseen_mass_asymptote
from peakprobe.toy.linear_attention.laws import (
    LAWS,
    compute_frontier,
    frontier_exponents,
    judge_exponent,
)
from peakprobe.toy.linear_attention.run import format_linear, reproduce_linear
from peakprobe.toy.linear_attention.sim import (
    _draw_m,
    draw_dataset,
    fullbatch_step,
    lsa_predict_dense,
    lsa_step,
    train_fresh,
)
from peakprobe.toy.linear_attention.sweep import QUICK, simulate_linear_attention
from peakprobe.toy.linear_attention.theory import (
    asymptotic_reducible,
    context_floor,
    context_r,
    feature_probs,
    loss_from_modes,
    mode_exact,
    population_loss,
    predicted_exponents,
    reduced_dynamics,
    riccati_s,
    solve_modes,
    task_context_exponent,
    task_context_modes,
    task_contexts,
)
from peakprobe.vocab import CONSISTENT, INCONCLUSIVE, INCONSISTENT


def test_sparse_sgd_step_equals_autograd_on_the_dense_attention():
    g = torch.Generator().manual_seed(0)
    s, m, b = 3, 6, 50
    w_k = torch.randn(s, m, m, generator=g, dtype=torch.float64)
    w_q = torch.randn(s, m, m, generator=g, dtype=torch.float64)
    feat = torch.randint(-1, m, (s, b), generator=g)  # -1: a feature the model does not embed
    h_val = torch.randn(s, b, generator=g, dtype=torch.float64)
    q_val = torch.randn(s, b, generator=g, dtype=torch.float64)
    y_q = torch.randn(s, b, generator=g, dtype=torch.float64)
    onehot = torch.nn.functional.one_hot(feat.clamp(min=0), m).to(torch.float64)
    onehot = onehot * (feat >= 0).unsqueeze(-1)  # (S, B, M); invisible tokens embed to 0
    dk, dq = w_k.clone().requires_grad_(), w_q.clone().requires_grad_()
    y_hat = lsa_predict_dense(dk, dq, onehot * h_val.unsqueeze(-1), onehot * q_val.unsqueeze(-1))
    ref_loss = 0.5 * ((y_q - y_hat) ** 2).mean(1)
    gk, gq = torch.autograd.grad(ref_loss.sum(), [dk, dq])
    lr = 0.3
    loss = lsa_step(w_k, w_q, feat, h_val, q_val, y_q, lr)
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(w_k, dk.detach() - lr * gk)
    torch.testing.assert_close(w_q, dq.detach() - lr * gq)


def test_fullbatch_step_equals_autograd_gd_on_explicit_context_tokens():
    """A training set written out token by token: h = (1/N) sum_i y_i x_i from the N context
    tokens, the dense readout, autograd over the whole set; the sufficient-statistics step must
    take the same step and report the same training loss."""
    rng = np.random.default_rng(3)
    m, n_feat, n_seq, n_ctx, reps = 5, 8, 40, 6, 2
    task = rng.integers(0, n_feat, (reps, n_seq))
    w = rng.choice([-1.0, 1.0], (reps, n_seq))
    g_ctx = rng.normal(size=(reps, n_seq, n_ctx))
    g_q = rng.normal(size=(reps, n_seq))
    visible = task < m
    onehot = np.eye(m)[np.minimum(task, m - 1)] * visible[..., None]  # (R, D, M)
    h = ((w[..., None] * g_ctx) * g_ctx).mean(-1)[..., None] * onehot  # sum_i y_i x_i / N
    x_q = g_q[..., None] * onehot
    g = torch.Generator().manual_seed(1)
    w_k = torch.randn(reps, m, m, generator=g, dtype=torch.float64)
    w_q = torch.randn(reps, m, m, generator=g, dtype=torch.float64)
    dk, dq = w_k.clone().requires_grad_(), w_q.clone().requires_grad_()
    y_hat = lsa_predict_dense(dk, dq, torch.from_numpy(h), torch.from_numpy(x_q))
    ref = 0.5 * ((torch.from_numpy(w * g_q) - y_hat) ** 2).mean(1)  # (R,)
    gk, gq = torch.autograd.grad(ref.sum(), [dk, dq])
    m_val = (g_ctx**2).mean(-1)
    a_sum, b_sum = np.zeros((reps, m)), np.zeros((reps, m))
    for r_ in range(reps):
        for j in range(n_seq):
            if visible[r_, j]:
                a_sum[r_, task[r_, j]] += g_q[r_, j] ** 2 * m_val[r_, j]
                b_sum[r_, task[r_, j]] += g_q[r_, j] ** 2 * m_val[r_, j] ** 2
    c_sum = (g_q**2).sum(1)
    lr = 0.2
    loss = fullbatch_step(w_k, w_q, torch.from_numpy(a_sum), torch.from_numpy(b_sum),
                          torch.from_numpy(c_sum), n_seq, lr)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(w_k, dk.detach() - lr * gk)
    torch.testing.assert_close(w_q, dq.detach() - lr * gq)


def test_sampled_m_has_the_chi_square_moments_and_datasets_their_expectations():
    rng = np.random.default_rng(4)
    for n in (2, 8, 64):
        m = _draw_m(rng, np.asarray(float(n)), (200_000,))
        assert m.mean() == pytest.approx(1.0, abs=0.01)
        assert m.var() == pytest.approx(2.0 / n, rel=0.03)  # chi^2_N / N
    assert np.all(_draw_m(rng, np.asarray(math.inf), (10,)) == 1.0)
    probs = feature_probs(50, 0.8)
    d, reps, n = 400, 500, 16
    a_sum, b_sum, c_sum, counts = draw_dataset(rng, d, reps, probs, 10, n)
    # E[n_k] = D p_k, E[A_k] = D p_k E[g^2 m] = D p_k, E[B_k] = D p_k (1 + 2/N), E[C] = D;
    # each within 4 standard errors (compound Poisson: Var = D p_k E[x^2] per set)
    r2 = 1 + 2 / n
    e_m4 = (n + 2) * (n + 4) * (n + 6) / n**3  # E[m^4] of chi^2_N / N
    for got, per_seq, second in ((counts, 1.0, 1.0), (a_sum, 1.0, 3 * r2), (b_sum, r2, 3 * e_m4)):
        want = d * probs[:10] * per_seq
        se = np.sqrt(d * probs[:10] * second / reps)
        assert np.all(np.abs(got.mean(0) - want) < 4 * se), (got.mean(0), want)
    assert abs(c_sum.mean() - d) < 4 * math.sqrt(3 * d / reps)


def test_logistic_closed_form_matches_solve_ivp_for_balanced_start():
    probs = feature_probs(40, 0.8)[:12]
    tau = np.linspace(0.0, 3000.0, 401)
    closed = riccati_s(tau, probs, context=32, s0=0.01)
    numeric = solve_modes(tau, probs, context=32, s0=0.01, delta=0.0)
    np.testing.assert_allclose(numeric, closed, rtol=1e-5, atol=1e-9)


def test_exact_mode_solution_matches_solve_ivp():
    """Delta > 0, per-mode rates and r, starts below 0, near 0 and above the fixed point 1/r."""
    rate = np.array([0.3, 0.05, 0.01, 0.002, 0.0])
    r = np.array([1.0625, 1.5, 0.9, 1.2, 1.1])
    s0 = np.array([0.0, -0.003, 2.0, 0.001, 0.004])
    delta = 4e-4
    tau = np.linspace(0.0, 2000.0, 301)

    def rhs(_t, s):
        return rate * (1 - r * s) * np.sqrt(delta + 4 * s * s)

    ref = solve_ivp(rhs, (0, tau[-1]), s0, t_eval=tau, rtol=1e-10, atol=1e-13).y.T
    np.testing.assert_allclose(mode_exact(tau, rate, r=r, s0=s0, delta=delta), ref, rtol=1e-6, atol=1e-9)


def test_scalar_mode_ode_matches_the_full_vector_gradient_flow():
    """d kappa/dtau = g q, d q/dtau = g kappa with g = p (1 - r <kappa, q>), integrated on the
    vectors, must give the s(tau) of the reduced ODE with the conserved Delta."""
    rng = np.random.default_rng(1)
    dim, p, context = 7, 0.05, 32
    r = 1 + 2 / context
    kappa0, q0 = rng.normal(0, 0.05, dim), rng.normal(0, 0.05, dim)

    def rhs(_t, y):
        kappa, q = y[:dim], y[dim:]
        gain = p * (1 - r * kappa @ q)
        return np.concatenate([gain * q, gain * kappa])

    tau = np.linspace(0, 400, 201)
    full = solve_ivp(rhs, (0, tau[-1]), np.concatenate([kappa0, q0]), t_eval=tau, rtol=1e-10,
                     atol=1e-12).y
    s_full = np.einsum("it,it->t", full[:dim], full[dim:])
    s0 = kappa0 @ q0
    delta = (kappa0 @ kappa0 + q0 @ q0) ** 2 - 4 * s0**2
    s_red = solve_modes(tau, np.array([p]), context=context, s0=s0, delta=delta)[:, 0]
    np.testing.assert_allclose(s_red, s_full, rtol=1e-5, atol=1e-8)
    s_exact = mode_exact(tau, np.array([p]), r=r, s0=s0, delta=delta)[:, 0]
    np.testing.assert_allclose(s_exact, s_full, rtol=1e-5, atol=1e-8)
    assert s_full[-1] == pytest.approx(context / (context + 2), rel=1e-3)  # learned to s*


def _mc_loss(rng, probs, s, m, n_ctx_sampler, n=400_000):
    task = rng.choice(len(probs), size=n, p=probs)
    w = rng.choice([-1.0, 1.0], size=n)
    n_ctx = n_ctx_sampler(n)
    g_q = rng.normal(size=n)
    h = np.empty(n)
    for value in np.unique(n_ctx):  # tokens written out: h = sum_i y_i g_i / N
        rows = np.flatnonzero(n_ctx == value)
        g_ctx = rng.normal(size=(len(rows), int(value)))
        h[rows] = (w[rows, None] * g_ctx * g_ctx).mean(1)
    s_task = np.where(task < m, s[np.minimum(task, m - 1)], 0.0)
    return (0.5 * (w * g_q - s_task * h * g_q) ** 2).mean()


def test_loss_formulas_match_brute_force_monte_carlo_of_the_data():
    rng = np.random.default_rng(2)
    n_feat, a, m = 30, 0.8, 10
    probs = feature_probs(n_feat, a)
    s = rng.uniform(0.0, 1.0, m)
    mc = _mc_loss(rng, probs, s, m, lambda n: np.full(n, 8))
    assert mc == pytest.approx(loss_from_modes(s[None, :], probs, m, 8)[0], rel=0.02)
    # N drawn per sequence: only E[m^2] = 1 + 2 E[1/N] enters
    values, weights = power_law_context(2, 12, 2.0)
    mc = _mc_loss(rng, probs, s, m, lambda n: rng.choice(values, size=n, p=weights))
    assert mc == pytest.approx(population_loss(s, probs, context_r(values, weights)), rel=0.02)
    assert context_r(values, weights) == pytest.approx(1 + 2 * (weights / values).sum())


def test_step_function_closed_form_has_the_ode_exponent():
    """A wide model (M = 1024): the ODE's loss above the floor follows the closed form
    (s*/2) sum_{k > k*(t)} p_k within 20%, and both fall as t^-(a/(1+a))."""
    a = 0.8
    probs = feature_probs(4096, a)
    red = reduced_dynamics(model_sizes=(1024,), steps=20_000, zipf_a=a, method="closed")
    t = np.geomspace(100, 19_999, 12).astype(int)
    ode = red.loss[0][t] - context_floor(32)
    closed = asymptotic_reducible(t, probs, a, lr=1.0, context=32, init_scale=0.1)
    assert np.all(np.abs(closed / ode - 1) < 0.2)
    slope_ode = -np.polyfit(np.log(t), np.log(ode), 1)[0]
    slope_closed = -np.polyfit(np.log(t), np.log(closed), 1)[0]
    assert slope_ode == pytest.approx(a / (1 + a), abs=0.02)
    assert slope_closed == pytest.approx(a / (1 + a), abs=0.02)


def test_unseen_mass_asymptote_matches_the_exact_sum():
    a = 0.8
    probs = feature_probs(2_000_000, a)
    for d in (1e4, 1e5):
        exact = 0.5 * 0.9 * float((probs * (1 - probs) ** d).sum())
        assert unseen_mass_asymptote(np.array([d]), a, probs, 0.9)[0] == pytest.approx(exact, rel=0.03)


def test_compute_frontier_recovers_a_planted_scaling_form():
    """L(M, t) = M^-a Phi(t / M^(1+a)) has frontier C^-(a/(2+a)) and M_opt ~ C^(1/(2+a))."""
    a = 0.8
    sizes = tuple(int(round(8 * 2 ** (i / 2))) for i in range(7))
    t = np.geomspace(1, 1e6, 300)
    curves = np.stack([m ** (-a) * (1 + (t / m ** (1 + a)) ** (-a / (1 + a))) for m in sizes])
    fits = frontier_exponents(compute_frontier(sizes, t, curves), n_boot=0)
    assert fits["loss"][0] == pytest.approx(a / (2 + a), abs=0.01)
    assert fits["size"][0] == pytest.approx(1 / (2 + a), abs=0.01)


def test_exponent_formulas_and_verdicts():
    e = predicted_exponents(0.5)
    assert e["time"] == pytest.approx(1 / 3) and e["model_size"] == pytest.approx(0.5)
    assert e["data"] == pytest.approx(1 / 3) and e["compute"] == pytest.approx(0.2)
    assert e["compute_size"] == pytest.approx(0.4) and e["context"] == 1.0
    assert predicted_exponents(1.0)["time"] == pytest.approx(0.5)
    assert context_floor(32) == pytest.approx(1 / 34) and context_floor(math.inf) == 0.0
    assert judge_exponent(0.45, 0.44, 0.46, 0.444) == CONSISTENT
    assert judge_exponent(0.45, 0.40, 0.50, 0.444) == INCONCLUSIVE  # interval crosses the band
    assert judge_exponent(0.48, 0.47, 0.49, 0.444) == INCONSISTENT
    assert judge_exponent(0.48, 0.40, 0.55, 0.444) == INCONSISTENT  # the value itself is out
    assert judge_exponent(0.45, float("nan"), 0.46, 0.444) == INCONCLUSIVE


def test_bad_arguments_raise_one_line_value_errors(tmp_path):
    with pytest.raises(ToyConfigError, match="exceed n_features"):
        simulate_linear_attention(model_sizes=(16, 64), n_features=32, progress=False)
    with pytest.raises(ValueError, match="init"):
        simulate_linear_attention(init="orthogonal", progress=False)
    with pytest.raises(ToyConfigError, match="unknown law"):
        reproduce_linear(tmp_path, quick=True, progress=False, laws=("time", "depth"))


def test_finite_data_follows_its_reduced_dynamics_and_plateaus():
    """Small data-law run: the GD simulation on each set tracks the closed-form modes on the
    same set (within 10% along the curve, 2% at the end), a larger set ends lower, and fresh
    data ends below every finite set."""
    settings = dict(model_size=16, sizes=(16, 32, 64, 128), replicas=8, tau_per_seq=20.0, lr=0.5,
                    n_eval=10)
    law, run = data_law(settings=settings, n_boot=200)
    for sim, red in zip(run.loss_sim, run.loss_reduced, strict=True):
        # the first features move in a few steps, where discrete GD departs from the flow
        np.testing.assert_allclose(sim.mean(1), red.mean(1), rtol=0.1)
        assert sim[-1].mean() == pytest.approx(red[-1].mean(), rel=0.02)
    final = law.details["final_reducible_sim"]
    assert np.all(np.diff(final) < 0)
    assert run.fresh_reduced[-1] - run.floor < final[-1]
    assert law.exponents[0].predicted == pytest.approx(0.8 / 1.8)


TINY_CONTEXT = dict(
    floor=dict(model_size=8, contexts=(4, 8, 16, 32, 64, math.inf), seeds=2, steps=300),
    independent=dict(model_size=16, n_min=8, n_max=64, power=2.0, seeds=2, steps=400),
    coupled=dict(model_size=16, n0=32, betas=(0.3, 0.6), seeds=2, init_scale=1e-6, first_rate=0.5))


def test_context_floor_and_both_varying_contexts_against_their_reduced_dynamics():
    law, run = context_law(settings=TINY_CONTEXT, n_boot=200)
    values, weights = power_law_context(8, 64, 2.0)
    assert run.independent.info["r"] == pytest.approx(1 + 2 * float((weights / values).sum()))
    diff = law.details["diff_sim"]
    np.testing.assert_allclose(diff, law.details["diff_reduced"], rtol=0.1)
    # L(N) - L(inf) = (1 - V)/(N+2) to leading order: (N+2) * diff nearly constant
    scaled = diff * (np.array([4, 8, 16, 32, 64]) + 2)
    assert scaled.max() / scaled.min() < 1.15
    assert law.exponents[0].fitted == pytest.approx(1.0, abs=0.05)
    assert [e.name for e in law.exponents] == ["context", "time_random_context",
                                              "time_task_context", "time_task_context"]
    assert "unchanged by construction" in law.exponents[1].law
    for curve, beta in zip(run.coupled, (0.3, 0.6), strict=True):
        # the SGD run follows its reduced dynamics through the window (population loss, 2 seeds;
        # a transition's timing jitters with the initial modes, so single points stray more)
        t_lo, t_hi = curve.window
        win = (curve.steps >= t_lo) & (curve.steps <= t_hi)
        dev = np.abs(curve.sim.mean(1)[win] / curve.reduced[win] - 1)
        assert dev.max() < 0.2 and dev.mean() < 0.06, dev
        assert curve.predicted == pytest.approx(0.8 / (1.8 - beta))
        probs = feature_probs(4096, 0.8)
        assert curve.floor == pytest.approx(float((probs / (32 * np.arange(1, 4097) ** beta + 2)).sum()))


def test_summed_readout_modes_match_the_vector_gradient_flow():
    """The summed readout h = w N m e_k: d kappa/dtau = G q, dq/dtau = G kappa with
    G = p N (1 - r N <kappa, q>), integrated on the vectors; task_context_modes must give
    u = N <kappa, q> from an independent start."""
    rng = np.random.default_rng(5)
    dim, sigma0 = 6, 1e-3
    probs = np.array([0.3, 0.05])
    n = np.array([16.0, 90.0])
    tau = np.linspace(0.0, 60.0, 121)
    for k in range(2):
        r = 1 + 2 / n[k]
        kappa0, q0 = rng.normal(0, sigma0 / math.sqrt(dim), (2, dim))

        def rhs(_t, y, k=k, r=r):
            kappa, q = y[:dim], y[dim:]
            gain = probs[k] * n[k] * (1 - r * n[k] * kappa @ q)
            return np.concatenate([gain * q, gain * kappa])

        full = solve_ivp(rhs, (0, tau[-1]), np.concatenate([kappa0, q0]), t_eval=tau,
                         rtol=1e-10, atol=1e-14).y
        u_full = n[k] * np.einsum("it,it->t", full[:dim], full[dim:])
        a0 = kappa0 @ kappa0 + q0 @ q0
        s0 = kappa0 @ q0
        # task_context_modes starts from the typical s = 0, Delta = 4 sigma0^4; give it this start
        u_red = mode_exact(tau, np.array([probs[k] * n[k]]), r=r, s0=n[k] * s0,
                           delta=n[k] ** 2 * (a0**2 - 4 * s0**2))[:, 0]
        np.testing.assert_allclose(u_red, u_full, rtol=1e-5, atol=1e-9)
        assert u_full[-1] == pytest.approx(1 / r, rel=1e-3)  # learned to u* = 1/r = N/(N+2)
    typical = task_context_modes(tau, probs, n, init_scale=sigma0)  # (T, 2)
    assert typical[0] == pytest.approx([0.0, 0.0])
    assert typical[-1, 0] == pytest.approx(n[0] / (n[0] + 2), rel=1e-3)


def test_summed_readout_loss_matches_brute_force_monte_carlo():
    """Tokens written out, h = sum_i y_i x_i with N_k tokens for task k: the mean loss equals
    population_loss of the modes u_k = N_k s_k with r_k = 1 + 2/N_k."""
    rng = np.random.default_rng(6)
    n_feat, m = 12, 6
    probs = feature_probs(n_feat, 0.8)
    n_all = np.round(task_contexts(n_feat, 3, 0.7))  # integer token counts 3..17
    s = rng.uniform(0.0, 0.3, m) / n_all[:m]
    count = 400_000
    task = rng.choice(n_feat, size=count, p=probs)
    w = rng.choice([-1.0, 1.0], size=count)
    g_q = rng.normal(size=count)
    h = np.empty(count)
    for k in range(n_feat):
        rows = np.flatnonzero(task == k)
        g_ctx = rng.normal(size=(len(rows), int(n_all[k])))
        h[rows] = (w[rows, None] * g_ctx * g_ctx).sum(1)  # summed, not averaged
    s_task = np.where(task < m, s[np.minimum(task, m - 1)], 0.0)
    mc = (0.5 * (w * g_q - s_task * h * g_q) ** 2).mean()
    assert mc == pytest.approx(population_loss(s * n_all[:m], probs, 1 + 2 / n_all), rel=0.02)


def test_task_coupled_reduced_dynamics_have_the_derived_exponent():
    """The closed-form modes of the quick and default settings (M = 32, 64), fitted over the
    law's own window, fall as t^-(a/(1+a-beta)) within 0.03 for beta = 0.3, 0.5; beta = 0
    (N fixed) gives back a/(1+a)."""
    from peakprobe.toy.linear_attention.laws import fit_exponent
    from peakprobe.toy.linear_attention.theory import task_half_time

    probs = feature_probs(4096, 0.8)
    for m in (32, 64):
        for beta in (0.0, 0.3, 0.5):
            n_all = task_contexts(4096, 32, beta)
            lr = 0.5 / (probs[0] * 32)
            t_lo, t_hi = task_half_time(np.array([3, m // 2]), probs, n_all, lr=lr, init_scale=1e-6)
            t = np.geomspace(t_lo, t_hi, 25)
            u = task_context_modes(lr * t, probs[:m], n_all[:m], init_scale=1e-6)
            excess = population_loss(u, probs, 1 + 2 / n_all) - float((probs / (n_all + 2)).sum())
            alpha = fit_exponent(t, excess, n_boot=0)[0]
            assert alpha == pytest.approx(task_context_exponent(0.8, beta), abs=0.03), (m, beta)
    assert task_context_exponent(0.8, 0.0) == pytest.approx(0.8 / 1.8)
    with pytest.raises(ValueError, match="beta"):
        task_context_exponent(0.8, 1.8)


def test_train_fresh_with_a_task_context_reads_the_summed_context():
    """One SGD step from known weights: the batch loss train_fresh reports equals the loss of
    the dense readout on the same draw, with h = w N_k m."""
    probs = feature_probs(8, 0.8)
    n_all = task_contexts(8, 4, 1.0)
    run = train_fresh(8, probs, steps=1, seeds=1, batch=20_000, lr=0.0, init_scale=0.5,
                      init="balanced", task_context=n_all, eval_steps=np.array([0]), seed=3)
    u = run.modes[0, 0] * n_all  # learning rate 0: the modes stay
    want = float(population_loss(u, probs, 1 + 2 / n_all))
    assert run.loss[0, 0] == pytest.approx(want, rel=0.05)


@pytest.mark.slow
def test_default_context_law_task_coupled_exponents_within_0_03():
    """The default run of ``--law context``: each task-coupled exponent within 0.03 of
    a/(1+a-beta) (its verdict consistent), the control within 0.03 of a/(1+a)."""
    law, _ = context_law(n_boot=300)
    names = [e.name for e in law.exponents]
    assert names.count("time_task_context") == 2
    for e in law.exponents[1:]:
        assert abs(e.fitted - e.predicted) <= 0.03, e
        assert e.verdict == CONSISTENT, e


def test_quick_run_of_all_five_laws(tmp_path):
    """The quick run: every law's simulated exponent next to its reduced dynamics (within 0.03)
    and the closed-form prediction (within 0.05 at these small sizes), files and the printout."""
    summary = reproduce_linear(tmp_path, quick=True, progress=False)
    a = summary["config"]["zipf_a"]
    closed = {"time": a / (1 + a), "model_size": a, "data": a / (1 + a), "compute": a / (2 + a),
              "compute_size": 1 / (2 + a), "context": 1.0, "time_random_context": a / (1 + a)}
    betas = iter(summary["results"]["context"]["details"]["config"]["coupled"]["betas"])
    assert list(summary["results"]) == list(LAWS)
    for law in LAWS:
        res = summary["results"][law]
        assert (tmp_path / res["figure"]).stat().st_size > 10_000
        for e in res["exponents"]:
            if e["name"] == "time_task_context":  # N_k = N_0 k^beta: a/(1+a-beta), within 0.03
                assert e["predicted"] == pytest.approx(a / (1 + a - next(betas))), e
                assert abs(e["fitted"] - e["predicted"]) <= 0.03, e
                continue
            assert e["predicted"] == pytest.approx(closed[e["name"]]), e
            assert e["lo"] <= e["fitted"] <= e["hi"], e
            assert abs(e["fitted"] - e["reduced"]) <= 0.03, e
            assert abs(e["fitted"] - closed[e["name"]]) <= 0.05, e
    table = summary["table"]
    assert [row["model_size"] for row in table] == list(QUICK["model_sizes"])
    for row in table:
        assert row["final_loss_sim"] == pytest.approx(row["final_loss_reduced"], rel=0.03)
    assert summary["acceptance"]
    saved = json.loads((tmp_path / vocab.TOY_FILE).read_text())
    assert saved["results"]["data"]["exponents"][0]["fitted"] == pytest.approx(
        summary["results"]["data"]["exponents"][0]["fitted"])
    text = format_linear(saved)
    for title in ("time:", "model size:", "data size:", "compute:", "context length:"):
        assert sum(line.startswith(title) for line in text.splitlines()) == 1, text
    assert (tmp_path / "linear_attention_table.csv").exists()


def test_a_subset_of_laws_runs_only_those(tmp_path, monkeypatch):
    from peakprobe.toy.linear_attention import context

    monkeypatch.setattr(context, "CONTEXT_QUICK", TINY_CONTEXT)
    summary = reproduce_linear(tmp_path, quick=True, progress=False, laws=["context"])
    assert list(summary["results"]) == ["context"]
    assert summary["plots"] == ["linear_attention_context.png"]
    assert format_linear(summary).startswith("context length:")
