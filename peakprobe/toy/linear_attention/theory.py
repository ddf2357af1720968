"""Reduced dynamics of the solvable linear self-attention toy (derivation: docs/linear_attention.md).

Per feature k <= M only the mode s_k = <W_K e_k, W_Q e_k> matters. With r = E[m^2] = 1 + 2/N,
s* = 1/r and tau = lr * step, gradient flow gives the scalar ODE

    ds_k/dtau = p_k (1 - r s_k) sqrt(Delta_k + 4 s_k^2),   Delta_k conserved,            (*)

solved in closed form by ``mode_exact`` (any Delta, rate, r and start; ``riccati_s`` is the
balanced-start logistic). The population loss of given modes is exact (``population_loss``).
N drawn per sequence independently of the task changes only r (``context_r``); N tied to the
task with the summed readout changes each feature's rate (``task_context_modes``,
``task_context_exponent``). ``predicted_exponents`` holds the asymptotic exponents of every law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

__all__ = [
    "ReducedDynamics",
    "asymptotic_reducible",
    "context_floor",
    "context_r",
    "effective_s0",
    "feature_probs",
    "half_time",
    "loss_floor",
    "loss_from_modes",
    "mode_exact",
    "population_loss",
    "predicted_exponents",
    "reduced_dynamics",
    "riccati_s",
    "s_star",
    "solve_modes",
    "task_context_exponent",
    "task_context_modes",
    "task_contexts",
    "task_half_time",
]


def feature_probs(n_features: int, zipf_a: float) -> np.ndarray:
    """p_k = k^-(1+a) / sum_j j^-(1+a) for k = 1..n_features (index 0 is feature 1)."""
    k = np.arange(1, int(n_features) + 1, dtype=np.float64)
    w = k ** (-(1.0 + float(zipf_a)))
    return w / w.sum()


def context_r(context: float, weights: np.ndarray | None = None) -> float:
    """r = E[m^2] = 1 + 2 E[1/N] for m = (1/N) sum_i g_i^2: a fixed N (``weights`` None; N = inf
    gives 1) or N drawn per sequence from the values ``context`` with probabilities ``weights``."""
    if weights is None:
        return 1.0 if math.isinf(float(context)) else 1.0 + 2.0 / float(context)
    n = np.asarray(context, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    return 1.0 + 2.0 * float((w / n).sum() / w.sum())


def s_star(context: float) -> float:
    """The per-feature optimum of s: E[m] / E[m^2] = N / (N + 2), m = (1/N) sum g_i^2."""
    return 1.0 / context_r(context)


def context_floor(context: float) -> float:
    """Loss of an infinitely wide, fully trained model: (1 - s*) / 2 = 1 / (N + 2)."""
    return 0.5 * (1.0 - s_star(context))


def loss_floor(model_size: int, probs: np.ndarray, context: float) -> float:
    """L_inf(M) = 1/(N+2) + (s*/2) * (mass of the features the model cannot see)."""
    return context_floor(context) + 0.5 * s_star(context) * float(probs[int(model_size):].sum())


def effective_s0(init_scale: float, init: str = "independent") -> float:
    """Start value of the logistic that the mode follows once s_k >> sqrt(Delta).

    balanced (W_Q = W_K at start): s0 = E|kappa|^2 = sigma0^2 exactly as a Riccati start.
    independent: s(0) = 0, A(0) = 2 sigma0^2, early s = (A/2) sinh(2 p tau) ~ (A/4) e^{2 p tau},
    so the logistic it joins starts at A/4 = sigma0^2 / 2.
    """
    if init == "balanced":
        return float(init_scale) ** 2
    return 0.5 * float(init_scale) ** 2


def half_time(k: int | np.ndarray, probs: np.ndarray, *, lr: float, context: float,
              init_scale: float, init: str = "independent", r: float | None = None) -> np.ndarray:
    """Step at which feature k (1-based) reaches s*/2 on the logistic: ln(s*/s0 - 1) / (2 lr p_k).

    ``r`` (E[m^2]) overrides the one of the fixed ``context``."""
    target = 1.0 / r if r is not None else s_star(context)
    c = target / effective_s0(init_scale, init) - 1.0
    k = np.asarray(k)
    return np.log(c) / (2.0 * lr * probs[k - 1])


def riccati_s(tau: np.ndarray, probs: np.ndarray, *, context: float, s0: float) -> np.ndarray:
    """Closed-form logistic solution s_k(tau) = s* / (1 + (s*/s0 - 1) exp(-2 p_k tau)).

    ``tau`` (T,), ``probs`` (M,) -> (T, M). Exact for the balanced start (Delta = 0).
    """
    ss = s_star(context)
    tau = np.asarray(tau, dtype=np.float64)[:, None]  # (T, 1)
    x = np.clip(-2.0 * probs[None, :] * tau, -700.0, 700.0)  # (T, M)
    return ss / (1.0 + (ss / s0 - 1.0) * np.exp(x))


def mode_exact(tau: np.ndarray, rate: np.ndarray, *, r: float | np.ndarray,
               s0: float | np.ndarray, delta: float | np.ndarray) -> np.ndarray:
    """Closed-form solution of ds/dtau = rate (1 - r s) sqrt(Delta + 4 s^2), one mode per entry.

    ``tau`` (T,), ``rate`` (K,) (0: the mode never moves), ``r``, ``s0`` and ``delta`` scalars or
    (K,) -> s (T, K); ``delta`` is either 0 everywhere or positive everywhere. With s = (sqrt(Delta)/2) sinh(theta), x = e^theta and c = r sqrt(Delta)/2 the
    equation separates: Q(x) = (x+ - x) / (x - x-) decays as exp(-2 sqrt(1 + c^2) rate tau),
    x+- = (1 +- sqrt(1 + c^2)) / c, and x+ is the fixed point s = 1/r (derivation in
    docs/linear_attention.md). Delta = 0 is the logistic ``riccati_s``.
    """
    tau = np.asarray(tau, dtype=np.float64)[:, None]  # (T, 1)
    rate = np.asarray(rate, dtype=np.float64)[None, :]  # (1, K)
    r = np.broadcast_to(np.asarray(r, dtype=np.float64), rate.shape[1:])[None, :]
    s0 = np.broadcast_to(np.asarray(s0, dtype=np.float64), rate.shape[1:])[None, :]
    delta = np.broadcast_to(np.asarray(delta, dtype=np.float64), rate.shape[1:])[None, :]
    if np.all(delta <= 0.0):
        target = 1.0 / r
        x = np.clip(-2.0 * rate * tau, -700.0, 700.0)
        return np.broadcast_to(target / (1.0 + (target / s0 - 1.0) * np.exp(x)), (tau.shape[0], rate.shape[1]))
    root = np.sqrt(delta)  # (1, K)
    c = r * root / 2.0  # (1, K)
    rt = np.sqrt(1.0 + c * c)
    x_plus, x_minus = (1.0 + rt) / c, (1.0 - rt) / c
    u0 = 2.0 * s0 / root
    x0 = u0 + np.sqrt(1.0 + u0 * u0)
    q = (x_plus - x0) / (x0 - x_minus) * np.exp(-2.0 * rt * rate * tau)  # (T, K)
    x = (x_plus + q * x_minus) / (1.0 + q)
    return 0.25 * root * (x - 1.0 / x)


def solve_modes(tau: np.ndarray, probs: np.ndarray, *, context: float, s0: float | np.ndarray,
                delta: float | np.ndarray, rtol: float = 1e-8, atol: float = 1e-12,
                r: float | None = None) -> np.ndarray:
    """Integrate ds_k/dtau = p_k (1 - r s_k) sqrt(Delta_k + 4 s_k^2) with solve_ivp (LSODA).

    ``tau`` increasing (T,) starting at >= 0; ``probs`` (M,) -> s (T, M). ``r`` overrides the
    E[m^2] of the fixed ``context``.
    """
    r = context_r(context) if r is None else float(r)
    m = len(probs)
    s_init = np.broadcast_to(np.asarray(s0, dtype=np.float64), (m,)).copy()
    dlt = np.broadcast_to(np.asarray(delta, dtype=np.float64), (m,)).copy()
    tau = np.asarray(tau, dtype=np.float64)

    def rhs(_t: float, s: np.ndarray) -> np.ndarray:
        return probs * (1.0 - r * s) * np.sqrt(dlt + 4.0 * s * s)

    def jac(_t: float, s: np.ndarray) -> np.ndarray:
        root = np.sqrt(dlt + 4.0 * s * s)
        safe = np.where(root > 0, root, 1.0)
        return np.diag(probs * (-r * root + (1.0 - r * s) * 4.0 * s / safe))

    sol = solve_ivp(rhs, (0.0, float(tau[-1])), s_init, t_eval=tau, method="LSODA",
                    rtol=rtol, atol=atol, jac=jac)
    if not sol.success:
        raise RuntimeError(f"solve_ivp failed on the reduced dynamics: {sol.message}")
    return sol.y.T  # (T, M)


def population_loss(s: np.ndarray, probs_all: np.ndarray, r: float | np.ndarray) -> np.ndarray:
    """Population loss of a model with modes s (..., M) when E[m^2] = r (s* = 1/r):

    (1 - s*)/2 + (s*/2) sum_{k>M} p_k + (r/2) sum_{k<=M} p_k (s* - s_k)^2   -> (...,).

    ``r`` may differ per feature, (K,) like ``probs_all``: the summed readout of a task-coupled
    context, whose modes are u_k = N_k s_k (``task_context_modes``)."""
    m = s.shape[-1]
    r_all = np.broadcast_to(np.asarray(r, dtype=np.float64), probs_all.shape)  # (K,)
    target = 1.0 / r_all
    excess = 0.5 * (r_all[:m] * (target[:m] - s) ** 2 * probs_all[:m]).sum(axis=-1)
    floor = 0.5 * float((probs_all * (1.0 - target)).sum())
    return floor + 0.5 * float((target[m:] * probs_all[m:]).sum()) + excess


def loss_from_modes(s: np.ndarray, probs_all: np.ndarray, model_size: int, context: float) -> np.ndarray:
    """Population loss from the mode values s (T, M): L_inf(M) + (r/2) sum_k p_k (s* - s_k)^2."""
    if s.shape[-1] != int(model_size):
        raise ValueError(f"modes of shape {s.shape} do not match model_size={model_size}")
    return population_loss(s, probs_all, context_r(context))


@dataclass
class ReducedDynamics:
    """Loss curves of the reduced ODE system, one row per model size, at integer steps."""

    model_sizes: tuple[int, ...]
    steps: np.ndarray  # (T,) 0..steps-1: loss before the update of that step
    loss: np.ndarray  # (len(model_sizes), T)
    config: dict


def reduced_dynamics(
    *,
    model_sizes: tuple[int, ...] = (16, 32, 64),
    n_features: int = 4096,
    zipf_a: float = 0.8,
    context: float = 32,
    lr: float = 1.0,
    steps: int = 3000,
    init_scale: float = 0.1,
    init: str = "independent",
    method: str = "ode",
) -> ReducedDynamics:
    """Loss at every step 0..steps-1 predicted by the reduced dynamics, per model size.

    ``method="ode"`` integrates the per-feature ODE with solve_ivp from the typical start
    (independent: s = 0, Delta = (2 sigma0^2)^2; balanced: s = sigma0^2, Delta = 0);
    ``method="exact"`` evaluates the same solution in closed form (``mode_exact``);
    ``method="closed"`` uses the logistic closed form from ``effective_s0`` (exact for balanced).
    """
    probs = feature_probs(n_features, zipf_a)
    step_axis = np.arange(int(steps), dtype=np.float64)
    tau = lr * step_axis
    if init == "balanced":
        s0, delta = init_scale**2, 0.0
    else:
        s0, delta = 0.0, (2.0 * init_scale**2) ** 2
    losses = []
    for m in model_sizes:
        p = probs[: int(m)]
        if method == "closed":
            s = riccati_s(tau, p, context=context, s0=effective_s0(init_scale, init))
        elif method == "exact":
            s = mode_exact(tau, p, r=context_r(context), s0=s0, delta=delta)
        else:
            s = solve_modes(tau, p, context=context, s0=s0, delta=delta)
        losses.append(loss_from_modes(s, probs, int(m), context))
    config = dict(model_sizes=list(model_sizes), n_features=n_features, zipf_a=zipf_a,
                  context=context, lr=lr, steps=steps, init_scale=init_scale, init=init,
                  method=method)
    return ReducedDynamics(tuple(int(m) for m in model_sizes), step_axis, np.array(losses), config)


def predicted_exponents(zipf_a: float) -> dict:
    """Asymptotic exponents of this model for p_k ~ k^-(1+a) (derivations: docs/linear_attention.md).

    Loss above the context floor: ~ t^-(a/(1+a)) (``time``; also with N drawn per sequence
    independently of the task, ``time_random_context``), ~ M^-a (``model_size``; ~ P^-(a/2) in
    P = 2 M^2 weights, ``params``), ~ D^-(a/(1+a)) (``data``, D training sequences); on the
    compute frontier with C ~ M * steps, ~ C^-(a/(2+a)) (``compute``) at M_opt ~ C^(1/(2+a))
    (``compute_size``), and with the dense count C ~ M^2 * steps, C^-(a/(3+a))
    (``compute_dense``). At a fixed time the loss falls with the context length as (N+2)^-1
    (``context``). N tied to the task: ``task_context_exponent``."""
    a = float(zipf_a)
    return {"time": a / (1.0 + a), "model_size": a, "params": a / 2.0, "data": a / (1.0 + a),
            "compute": a / (2.0 + a), "compute_size": 1.0 / (2.0 + a),
            "compute_dense": a / (3.0 + a), "context": 1.0, "time_random_context": a / (1.0 + a)}


def task_context_exponent(zipf_a: float, beta: float) -> float:
    """Time exponent a/(1+a-beta) of the loss above its floor when the sequences of task k carry
    N_k = N_0 k^beta context tokens and the readout sums over them (0 <= beta < 1+a): feature k
    is learned at t ~ 1/(p_k N_k) ~ k^(1+a-beta) (docs/linear_attention.md, section 11)."""
    a, b = float(zipf_a), float(beta)
    if not 0.0 <= b < 1.0 + a:
        raise ValueError(f"beta must lie in [0, 1 + a) = [0, {1.0 + a:g}), got {b:g}")
    return a / (1.0 + a - b)


def task_contexts(n_features: int, n0: float, beta: float) -> np.ndarray:
    """N_k = N_0 k^beta for k = 1..n_features, (K,)."""
    return float(n0) * np.arange(1, int(n_features) + 1, dtype=np.float64) ** float(beta)


def task_context_modes(tau: np.ndarray, probs: np.ndarray, contexts: np.ndarray, *,
                       init_scale: float) -> np.ndarray:
    """Modes u_k = N_k s_k (T, M) of the summed readout from the independent start.

    With h = w N m e_k the prediction is w g_q m u_k, so u follows (*) with rate p_k N_k,
    r_k = 1 + 2/N_k and Delta_u = N_k^2 Delta, from u = 0 (``mode_exact``); ``probs`` and
    ``contexts`` are the model's M features."""
    n = np.asarray(contexts, dtype=np.float64)
    delta = (2.0 * float(init_scale) ** 2) ** 2
    return mode_exact(tau, probs * n, r=1.0 + 2.0 / n, s0=0.0, delta=n * n * delta)


def task_half_time(k: np.ndarray, probs: np.ndarray, contexts: np.ndarray, *, lr: float,
                   init_scale: float) -> np.ndarray:
    """Step at which feature k (1-based) of the summed readout is half learned:
    ln(u*/u0 - 1) / (2 lr p_k N_k), u* = 1/r_k, u0 = N_k sigma0^2 / 2 (``effective_s0``)."""
    k = np.asarray(k) - 1
    n = np.asarray(contexts, dtype=np.float64)[k]
    u0 = n * effective_s0(init_scale)
    return np.log(1.0 / ((1.0 + 2.0 / n) * u0) - 1.0) / (2.0 * lr * probs[k] * n)


def asymptotic_reducible(t: np.ndarray, probs: np.ndarray, zipf_a: float, *, lr: float,
                         context: int, init_scale: float, init: str = "independent") -> np.ndarray:
    """Closed form of the loss above the context floor for a model that sees every feature.

    Step-function picture: at step t the features k > k*(t) are unlearned, with
    2 lr p_k* t = ln C, i.e. k* = (2 lr p_1 t / ln C)^(1/(1+a)); the loss above the floor is
    (s*/2) sum_{k > k*} p_k ~ (s* / (2 a Z)) k*^-a ~ t^-(a/(1+a)). The smooth logistic transitions
    put the ODE about 10-15% below this with the same exponent.
    """
    c = s_star(context) / effective_s0(init_scale, init) - 1.0
    t = np.asarray(t, dtype=np.float64)
    k_star = (2.0 * lr * probs[0] * t / math.log(c)) ** (1.0 / (1.0 + float(zipf_a)))
    tail = np.concatenate([np.cumsum(probs[::-1])[::-1], [0.0]])  # tail[i] = sum_{j >= i} p_j
    idx = np.minimum(np.floor(k_star).astype(np.int64), len(probs))  # 0-based first unlearned
    return 0.5 * s_star(context) * tail[idx]
