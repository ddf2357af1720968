"""Tests of the solvable linear-attention toy (peakprobe.toy.linear_attention[_theory]).

References: torch autograd on the dense linear self-attention for the hand-written sparse SGD
step; brute-force integration of the full (kappa, q) vector gradient flow for the scalar mode
ODE; the closed-form logistic against solve_ivp; a brute-force Monte Carlo of the data for the
loss formula; and the acceptance run (simulation mean over 8 seeds vs the reduced dynamics).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from peakprobe.toy.linear_attention import (
    QUICK,
    ToyConfigError,
    cli_linear,
    lsa_predict_dense,
    lsa_step,
    simulate_linear_attention,
)
from peakprobe.toy.linear_attention_theory import (
    asymptotic_reducible,
    context_floor,
    feature_probs,
    loss_from_modes,
    predicted_exponents,
    reduced_dynamics,
    riccati_s,
    solve_modes,
)


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


def test_logistic_closed_form_matches_solve_ivp_for_balanced_start():
    probs = feature_probs(40, 0.8)[:12]
    tau = np.linspace(0.0, 3000.0, 401)
    closed = riccati_s(tau, probs, context=32, s0=0.01)
    numeric = solve_modes(tau, probs, context=32, s0=0.01, delta=0.0)
    np.testing.assert_allclose(numeric, closed, rtol=1e-5, atol=1e-9)


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
    assert s_full[-1] == pytest.approx(context / (context + 2), rel=1e-3)  # learned to s*


def test_loss_formula_matches_brute_force_monte_carlo_of_the_data():
    rng = np.random.default_rng(2)
    n_feat, a, context, m = 30, 0.8, 8, 10
    probs = feature_probs(n_feat, a)
    s = rng.uniform(0.0, 1.0, m)
    n = 400_000
    task = rng.choice(n_feat, size=n, p=probs)
    w = rng.choice([-1.0, 1.0], size=n)
    g_ctx = rng.normal(size=(n, context))
    g_q = rng.normal(size=n)
    h = (w[:, None] * g_ctx * g_ctx).mean(1)  # sum_i y_i g_i / N
    s_task = np.where(task < m, s[np.minimum(task, m - 1)], 0.0)
    y_hat = s_task * h * g_q
    mc = 0.5 * (w * g_q - y_hat) ** 2
    predicted = loss_from_modes(s[None, :], probs, m, context)[0]
    assert mc.mean() == pytest.approx(predicted, rel=0.02)


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


def test_exponent_formulas():
    e = predicted_exponents(0.5)
    assert e["time"] == pytest.approx(1 / 3) and e["model_size"] == pytest.approx(0.5)
    assert predicted_exponents(1.0)["time"] == pytest.approx(0.5)
    assert context_floor(32) == pytest.approx(1 / 34)


def test_bad_arguments_raise_one_line_value_errors():
    with pytest.raises(ToyConfigError, match="exceed n_features"):
        simulate_linear_attention(model_sizes=(16, 64), n_features=32, progress=False)
    with pytest.raises(ValueError, match="init"):
        simulate_linear_attention(init="orthogonal", progress=False)


def test_simulation_agrees_with_reduced_dynamics(tmp_path):
    """Acceptance: 3 model sizes (16, 32, 64), mean of 8 SGD seeds within 5% of the reduced ODE over the fit
    window, fitted time exponents within 0.05; the ODE's exponent near a/(1+a)."""
    summary = cli_linear(tmp_path, quick=True, progress=False)
    table = summary["table"]
    assert [row["model_size"] for row in table] == list(QUICK["model_sizes"])
    a = summary["config"]["zipf_a"]
    windowed = [row for row in table if row["model_size"] >= 16]
    assert len(windowed) == 3
    for row in windowed:
        assert row["n_points"] >= 5
        assert row["max_rel_dev"] <= 0.05, row
        assert abs(row["time_alpha_sim"] - row["time_alpha_reduced"]) <= 0.05, row
        assert abs(row["time_alpha_reduced"] - a / (1 + a)) <= 0.03, row
    for row in table:
        assert row["final_loss_sim"] == pytest.approx(row["final_loss_reduced"], rel=0.05)
    assert summary["acceptance"] and summary["n_sizes_agree"] == 3
    # converged size law of the closed form: exponent a (finite-size corrections only); at the
    # fixed end time the simulation and the reduced dynamics give the same size exponent
    assert summary["size"]["alpha_converged"] == pytest.approx(a, abs=0.05)
    assert summary["size"]["alpha_sim"] == pytest.approx(summary["size"]["alpha_reduced"], abs=0.05)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["time"]["alpha_reduced"] == pytest.approx(summary["time"]["alpha_reduced"])
    for name in ("linear_attention_curves.png", "linear_attention_sizes.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert (tmp_path / "linear_attention_table.csv").exists()
