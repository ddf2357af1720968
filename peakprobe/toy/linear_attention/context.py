"""Context-length law of the linear-attention toy: the floor over N, and two time laws with N
varying across sequences (docs/linear_attention.md, section 11).

Three fresh-data SGD experiments (``sim.train_fresh``), each evaluated with the exact population
loss of the weights (``theory.population_loss``) beside its reduced dynamics:

* **floor over N at a fixed time**: one group of replicas per context length N (N = inf
  included), sharing every random draw except m (common random numbers);
  L(N) - L(inf) ~ (N+2)^-1 at the last step;
* **the control, N drawn per sequence independently of the task** (P(N) ~ N^-power): every
  mode sees only E[m^2] = 1 + 2 E[1/N], so its time exponent is that of a fixed
  N_eff = 1/E[1/N], a/(1+a): unchanged by construction;
* **N tied to the task**: the sequences of task k carry N_k = N_0 k^beta tokens and the readout
  sums over them, so feature k learns at a rate ~ p_k N_k and the loss above its floor falls as
  t^-(a/(1+a-beta)) (``theory.task_context_exponent``), one run per beta.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from peakprobe.toy.linear_attention.config import DEFAULT
from peakprobe.toy.linear_attention.laws import Exponent, LawResult, fit_exponent
from peakprobe.toy.linear_attention.sim import train_fresh
from peakprobe.toy.linear_attention.theory import (
    context_r,
    feature_probs,
    half_time,
    mode_exact,
    population_loss,
    predicted_exponents,
    task_context_exponent,
    task_context_modes,
    task_contexts,
    task_half_time,
)

__all__ = ["CONTEXT_FULL", "CONTEXT_QUICK", "ContextRun", "TimeCurve", "context_law",
           "power_law_context", "run_context"]

INF = math.inf
# coupled: N_k = n0 k^beta with the summed readout; lr = first_rate / (p_1 N_0), so that feature 1
# moves as fast per step as in the mean readout at lr 1; init_scale 1e-6 keeps every start far
# below its target 1/(r_k N_k), which makes the start's log factor nearly the same for all k.
CONTEXT_FULL = dict(floor=dict(model_size=32, contexts=(4, 8, 16, 32, 64, 128, 256, INF), seeds=4,
                               steps=3000),
                    independent=dict(model_size=64, n_min=8, n_max=512, power=2.0, seeds=8,
                                     steps=3000),
                    coupled=dict(model_size=64, n0=32, betas=(0.3, 0.5), seeds=8,
                                 init_scale=1e-6, first_rate=0.5))
CONTEXT_QUICK = dict(floor=dict(model_size=16, contexts=(4, 8, 16, 32, 64, 128, INF), seeds=2,
                                steps=1000),
                     independent=dict(model_size=32, n_min=8, n_max=512, power=2.0, seeds=4,
                                      steps=1000),
                     coupled=dict(model_size=32, n0=32, betas=(0.3, 0.5), seeds=4,
                                  init_scale=1e-6, first_rate=0.5))
N_EVAL = 40
N_EVAL_COUPLED = 60
WINDOW_K_LO = 3
# the coupled runs go this far past the half time of feature M/2, the window's end
STEPS_PAST_WINDOW = 1.1


def power_law_context(n_min: int, n_max: int, power: float) -> tuple[np.ndarray, np.ndarray]:
    """(values, weights) of P(N) ~ N^-power on the integers n_min..n_max."""
    values = np.arange(int(n_min), int(n_max) + 1, dtype=np.float64)
    weights = values ** (-float(power))
    return values, weights / weights.sum()


def _eval_steps(steps: int, n_eval: int = N_EVAL) -> np.ndarray:
    return np.unique(np.round(np.concatenate([[0], np.geomspace(1, steps, n_eval - 1)])).astype(np.int64))


@dataclass
class TimeCurve:
    """One time-law run: population loss of the simulation (per seed) and of the reduced
    dynamics at ``steps``, the loss floor they fall to, and the fit window (steps)."""

    label: str
    steps: np.ndarray  # (E,)
    sim: np.ndarray  # (E, seeds)
    reduced: np.ndarray  # (E,)
    floor: float
    window: tuple[float, float]
    predicted: float
    info: dict = field(default_factory=dict)


@dataclass
class ContextRun:
    """The three context experiments."""

    contexts: tuple[float, ...]
    floor_steps: np.ndarray  # (E,)
    floor_sim: np.ndarray  # (G, E, seeds) population loss, group g = contexts[g]
    floor_reduced: np.ndarray  # (G, E)
    independent: TimeCurve  # the control, N drawn per sequence independently of the task
    coupled: list[TimeCurve]  # N tied to the task, one per beta
    config: dict
    wall_s: float


def _floor_runs(cfg: dict, probs: np.ndarray, common: dict) -> tuple:
    m, ctx = int(cfg["model_size"]), tuple(float(n) for n in cfg["contexts"])
    ev = _eval_steps(int(cfg["steps"]))
    run = train_fresh(m, probs, steps=int(cfg["steps"]), seeds=int(cfg["seeds"]), contexts=ctx,
                      eval_steps=ev, desc=f"linear attention context M={m}", **common)
    modes = run.modes.reshape(len(ev), len(ctx), int(cfg["seeds"]), m)  # (E, G, seeds, M)
    sim = np.stack([population_loss(modes[:, g], probs, context_r(n)) for g, n in enumerate(ctx)])
    delta = (2.0 * common["init_scale"] ** 2) ** 2
    red = np.stack([population_loss(mode_exact(common["lr"] * ev, probs[:m], r=context_r(n),
                                               s0=0.0, delta=delta), probs, context_r(n))
                    for n in ctx])  # (G, E)
    return ctx, ev, sim, red


def _independent_run(cfg: dict, probs: np.ndarray, zipf_a: float, common: dict) -> TimeCurve:
    """N drawn per sequence from P(N) ~ N^-power, the mean readout: the control."""
    m = int(cfg["model_size"])
    dist = power_law_context(cfg["n_min"], cfg["n_max"], cfg["power"])
    r_bar = context_r(*dist)
    ev = _eval_steps(int(cfg["steps"]))
    run = train_fresh(m, probs, steps=int(cfg["steps"]), seeds=int(cfg["seeds"]), context_dist=dist,
                      eval_steps=ev, desc=f"linear attention independent N M={m}", **common)
    delta = (2.0 * common["init_scale"] ** 2) ** 2
    red = population_loss(mode_exact(common["lr"] * ev, probs[:m], r=r_bar, s0=0.0, delta=delta),
                          probs, r_bar)
    lo, hi = half_time(np.array([WINDOW_K_LO, max(m // 2, WINDOW_K_LO)]), probs, lr=common["lr"],
                       context=INF, init_scale=common["init_scale"], init=common["init"], r=r_bar)
    n_eff = 2.0 / (r_bar - 1.0)
    label = (f"control, N drawn per sequence independently of the task, P(N) ~ N^-{cfg['power']:g} "
             f"on {cfg['n_min']}..{cfg['n_max']} (unchanged by construction: the ODE of a fixed "
             f"N_eff = 1/E[1/N] = {n_eff:.1f}, a/(1+a)): L - (1 - 1/r)/2 ~ t^-alpha")
    return TimeCurve(label, ev, population_loss(run.modes, probs, r_bar), red,
                     0.5 * (1.0 - 1.0 / r_bar), (float(lo), float(hi)), zipf_a / (1.0 + zipf_a),
                     {"r": r_bar, "n_eff": n_eff})


def _coupled_run(cfg: dict, beta: float, probs: np.ndarray, zipf_a: float, common: dict) -> TimeCurve:
    """N_k = N_0 k^beta for the sequences of task k, the summed readout."""
    m, sigma0 = int(cfg["model_size"]), float(cfg["init_scale"])
    n_all = task_contexts(len(probs), cfg["n0"], beta)  # (K,)
    r_all = 1.0 + 2.0 / n_all
    lr = float(cfg["first_rate"]) / (probs[0] * n_all[0])
    lo, hi = task_half_time(np.array([WINDOW_K_LO, max(m // 2, WINDOW_K_LO)]), probs, n_all,
                            lr=lr, init_scale=sigma0)
    steps = int(math.ceil(STEPS_PAST_WINDOW * hi))
    ev = _eval_steps(steps, N_EVAL_COUPLED)
    run = train_fresh(m, probs, steps=steps, seeds=int(cfg["seeds"]), batch=common["batch"], lr=lr,
                      init_scale=sigma0, init="independent", task_context=n_all, eval_steps=ev,
                      seed=common["seed"], progress=common["progress"],
                      desc=f"linear attention N_k = {cfg['n0']:g} k^{beta:g} M={m}")
    sim = population_loss(run.modes * n_all[:m], probs, r_all)  # modes u_k = N_k s_k
    red = population_loss(task_context_modes(lr * ev, probs[:m], n_all[:m], init_scale=sigma0),
                          probs, r_all)
    label = (f"N_k = {cfg['n0']:g} k^{beta:g} tied to the task, summed readout (a/(1+a-beta)): "
             f"L - sum_k p_k/(N_k+2) ~ t^-alpha")
    return TimeCurve(label, ev, sim, red, float((probs / (n_all + 2.0)).sum()),
                     (float(lo), float(hi)), task_context_exponent(zipf_a, beta),
                     {"beta": beta, "n0": cfg["n0"], "lr": lr, "steps": steps,
                      "init_scale": sigma0})


def run_context(*, floor: dict, independent: dict, coupled: dict,
                n_features: int = DEFAULT.n_features, zipf_a: float = DEFAULT.zipf_a,
                batch: int = DEFAULT.batch, lr: float = DEFAULT.lr,
                init_scale: float = DEFAULT.init_scale, init: str = DEFAULT.init, seed: int = 0,
                progress: bool = False, threads: int | None = 1) -> ContextRun:
    """Run the floor-over-N groups, the independent-N control and the task-coupled runs."""
    probs = feature_probs(n_features, zipf_a)
    common = dict(batch=batch, lr=lr, init_scale=init_scale, init=init, seed=seed, progress=progress)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    start = time.perf_counter()
    try:
        ctx, ev, floor_sim, floor_red = _floor_runs(floor, probs, common)
        control = _independent_run(independent, probs, zipf_a, common)
        tied = [_coupled_run(coupled, float(b), probs, zipf_a, common) for b in coupled["betas"]]
    finally:
        torch.set_num_threads(old)
    config = dict(floor=dict(floor, contexts=list(ctx)), independent=dict(independent),
                  coupled=dict(coupled, betas=list(coupled["betas"])), n_features=n_features,
                  zipf_a=zipf_a, batch=batch, lr=lr, init_scale=init_scale, init=init, seed=seed)
    return ContextRun(ctx, ev, floor_sim, floor_red, control, tied, config,
                      time.perf_counter() - start)


def _fit_time(name: str, curve: TimeCurve, n_boot: int, seed: int) -> Exponent:
    """Fit the loss above the curve's floor ~ t^-alpha over its window, simulation (seed mean)
    and reduced dynamics alike."""
    t_lo, t_hi = curve.window
    win = (curve.steps >= t_lo) & (curve.steps <= t_hi)
    t = curve.steps[win].astype(np.float64)
    a_s, lo_s, hi_s, _ = fit_exponent(t, curve.sim.mean(axis=1)[win] - curve.floor,
                                      n_boot=n_boot, seed=seed)
    a_r = fit_exponent(t, curve.reduced[win] - curve.floor, n_boot=n_boot, seed=seed)[0]
    return Exponent(name, curve.label, a_s, lo_s, hi_s, a_r, curve.predicted)


def context_law(*, quick: bool = False, seed: int = 0, progress: bool = False,
                settings: dict | None = None, n_boot: int = 1000) -> tuple[LawResult, ContextRun]:
    """Fit L(N) - L(inf) ~ (N+2)^-alpha at the last step, the control's time exponent and the
    task-coupled time exponents, each against its prediction."""
    cfg = dict(settings or (CONTEXT_QUICK if quick else CONTEXT_FULL))
    run = run_context(**cfg, seed=seed, progress=progress)
    ctx = np.asarray(run.contexts)
    if not np.isinf(ctx).any() or np.isfinite(ctx).sum() < 4:
        raise ValueError("the floor-over-N experiment needs N = inf and at least 4 finite N")
    g_inf = int(np.flatnonzero(np.isinf(ctx))[0])
    finite = np.isfinite(ctx)
    # common random numbers: difference to N = inf per seed, then the mean
    diff_sim = (run.floor_sim[:, -1, :] - run.floor_sim[g_inf, -1, :]).mean(axis=1)[finite]
    diff_red = (run.floor_reduced[:, -1] - run.floor_reduced[g_inf, -1])[finite]
    x = ctx[finite] + 2.0
    a_s, lo_s, hi_s, c_s = fit_exponent(x, diff_sim, n_boot=n_boot, seed=seed)
    a_r, _, _, c_r = fit_exponent(x, diff_red, n_boot=n_boot, seed=seed)
    exps = [Exponent("context", f"L(N) - L(inf) ~ (N+2)^-alpha at step {int(run.floor_steps[-1])}",
                     a_s, lo_s, hi_s, a_r, predicted_exponents(run.config["zipf_a"])["context"]),
            _fit_time("time_random_context", run.independent, n_boot, seed)]
    exps += [_fit_time("time_task_context", c, n_boot, seed) for c in run.coupled]
    details = {"contexts": [str(n) for n in run.contexts], "diff_sim": diff_sim,
               "diff_reduced": diff_red, "c_sim": c_s, "c_reduced": c_r,
               "independent": {"window": list(run.independent.window),
                               "floor": run.independent.floor, **run.independent.info},
               "coupled": [{"window": list(c.window), "floor": c.floor, **c.info}
                           for c in run.coupled],
               "config": run.config}
    return LawResult("context", "context length", exps, "linear_attention_context.png", run.wall_s,
                     details), run
