"""Tests of the solvable linear-attention toy (peakprobe.toy.linear_attention*).

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

from peakprobe.toy.linear_attention import (
    LAWS,
    QUICK,
    ToyConfigError,
    format_linear,
    lsa_predict_dense,
    lsa_step,
    reproduce_linear,
    simulate_linear_attention,
)
from peakprobe.toy.linear_attention_context import context_law, power_law_context
from peakprobe.toy.linear_attention_data import data_law, unseen_mass_asymptote
from peakprobe.toy.linear_attention_laws import (
    compute_frontier,
    frontier_exponents,
    judge_exponent,
)
from peakprobe.toy.linear_attention_sim import _draw_m, draw_dataset, fullbatch_step
from peakprobe.toy.linear_attention_theory import (
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


def test_context_floor_and_random_context_against_their_reduced_dynamics():
    settings = dict(floor=dict(model_size=8, contexts=(4, 8, 16, 32, 64, math.inf), seeds=2, steps=300),
                    random=dict(model_size=16, n_min=8, n_max=64, beta=2.0, seeds=2, steps=400))
    law, run = context_law(settings=settings, n_boot=200)
    values, weights = power_law_context(8, 64, 2.0)
    assert run.random_r == pytest.approx(1 + 2 * float((weights / values).sum()))
    diff = law.details["diff_sim"]
    np.testing.assert_allclose(diff, law.details["diff_reduced"], rtol=0.1)
    # L(N) - L(inf) = (1 - V)/(N+2) to leading order: (N+2) * diff nearly constant
    scaled = diff * (np.array([4, 8, 16, 32, 64]) + 2)
    assert scaled.max() / scaled.min() < 1.15
    assert law.exponents[0].fitted == pytest.approx(1.0, abs=0.05)


def test_quick_run_of_all_five_laws(tmp_path):
    """The quick run: every law's simulated exponent next to its reduced dynamics (within 0.03)
    and the closed-form prediction (within 0.05 at these small sizes), files and the printout."""
    summary = reproduce_linear(tmp_path, quick=True, progress=False)
    a = summary["config"]["zipf_a"]
    closed = {"time": a / (1 + a), "model_size": a, "data": a / (1 + a), "compute": a / (2 + a),
              "compute_size": 1 / (2 + a), "context": 1.0, "time_random_context": a / (1 + a)}
    assert list(summary["results"]) == list(LAWS)
    for law in LAWS:
        res = summary["results"][law]
        assert (tmp_path / res["figure"]).stat().st_size > 10_000
        for e in res["exponents"]:
            assert e["predicted"] == pytest.approx(closed[e["name"]]), e
            assert e["lo"] <= e["fitted"] <= e["hi"], e
            assert abs(e["fitted"] - e["reduced"]) <= 0.03, e
            assert abs(e["fitted"] - closed[e["name"]]) <= 0.05, e
    table = summary["table"]
    assert [row["model_size"] for row in table] == list(QUICK["model_sizes"])
    for row in table:
        assert row["final_loss_sim"] == pytest.approx(row["final_loss_reduced"], rel=0.03)
    assert summary["acceptance"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["results"]["data"]["exponents"][0]["fitted"] == pytest.approx(
        summary["results"]["data"]["exponents"][0]["fitted"])
    text = format_linear(saved)
    for title in ("time:", "model size:", "data size:", "compute:", "context length:"):
        assert sum(line.startswith(title) for line in text.splitlines()) == 1, text
    assert (tmp_path / "linear_attention_table.csv").exists()


def test_a_subset_of_laws_runs_only_those(tmp_path):
    summary = reproduce_linear(tmp_path, quick=True, progress=False, laws=["context"])
    assert list(summary["results"]) == ["context"]
    assert summary["plots"] == ["linear_attention_context.png"]
    assert format_linear(summary).startswith("context length:")
