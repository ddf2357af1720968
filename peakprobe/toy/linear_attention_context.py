"""Context-length law of the linear-attention toy: the floor over N, and N drawn per sequence.

Two fresh-data SGD experiments (``linear_attention_sim.train_fresh``), both evaluated with the
population loss of the weights (exact for given modes, ``population_loss``):

* **floor over N at a fixed time**: one group of replicas per context length N (including
  N = inf, where m = 1), sharing initial weights and every draw except m (common random
  numbers); at the last step L(N) - L(inf) ~ (N+2)^-1 (docs/linear_attention.md, section 11);
* **time law with N drawn per sequence** from P(N) ~ N^-beta on [N_min, N_max]: the modes see
  E[m] = 1 and E[m^2] = 1 + 2 E[1/N] only, so the loss above the new floor (1 - 1/r)/2 falls
  as t^-(a/(1+a)), the same exponent as for a fixed N, fitted over the same window.

The reduced dynamics are the closed-form modes (``mode_exact``) with r = 1 + 2/N, resp.
r = 1 + 2 E[1/N].

Public names: ``CONTEXT_FULL``, ``CONTEXT_QUICK``, ``ContextRun``, ``run_context``,
``context_law``, ``power_law_context``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from peakprobe.toy.linear_attention_laws import Exponent, LawResult, fit_exponent
from peakprobe.toy.linear_attention_sim import train_fresh
from peakprobe.toy.linear_attention_theory import (
    context_r,
    feature_probs,
    half_time,
    mode_exact,
    population_loss,
    predicted_exponents,
)

__all__ = ["CONTEXT_FULL", "CONTEXT_QUICK", "ContextRun", "context_law", "power_law_context",
           "run_context"]

INF = math.inf
CONTEXT_FULL = dict(floor=dict(model_size=32, contexts=(4, 8, 16, 32, 64, 128, 256, INF), seeds=4,
                               steps=3000),
                    random=dict(model_size=64, n_min=8, n_max=512, beta=2.0, seeds=8, steps=3000))
CONTEXT_QUICK = dict(floor=dict(model_size=16, contexts=(4, 8, 16, 32, 64, 128, INF), seeds=2,
                                steps=1000),
                     random=dict(model_size=32, n_min=8, n_max=512, beta=2.0, seeds=4, steps=1000))
BASE = dict(n_features=4096, zipf_a=0.8, batch=512, lr=1.0, init_scale=0.1, init="independent")
N_EVAL = 40
WINDOW_K_LO = 3


def power_law_context(n_min: int, n_max: int, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """(values, weights) of P(N) ~ N^-beta on the integers n_min..n_max."""
    values = np.arange(int(n_min), int(n_max) + 1, dtype=np.float64)
    weights = values ** (-float(beta))
    return values, weights / weights.sum()


def _eval_steps(steps: int) -> np.ndarray:
    return np.unique(np.round(np.concatenate([[0], np.geomspace(1, steps, N_EVAL - 1)])).astype(np.int64))


@dataclass
class ContextRun:
    """Both context experiments: population-loss curves of simulation and reduced dynamics."""

    contexts: tuple[float, ...]
    floor_steps: np.ndarray  # (E,)
    floor_sim: np.ndarray  # (G, E, seeds) population loss, group g = contexts[g]
    floor_reduced: np.ndarray  # (G, E)
    random_steps: np.ndarray  # (E2,)
    random_sim: np.ndarray  # (E2, seeds)
    random_reduced: np.ndarray  # (E2,)
    random_r: float  # 1 + 2 E[1/N]
    fixed_reduced: np.ndarray  # (E2,) same model with N fixed at the base context, for contrast
    fixed_context: float
    window: tuple[float, float]  # time-fit window (steps) of the random-N run
    config: dict
    wall_s: float


def run_context(*, floor: dict, random: dict, n_features: int = BASE["n_features"],
                zipf_a: float = BASE["zipf_a"], batch: int = BASE["batch"], lr: float = BASE["lr"],
                init_scale: float = BASE["init_scale"], init: str = BASE["init"],
                fixed_context: float = 32, seed: int = 0, progress: bool = False,
                threads: int | None = 1) -> ContextRun:
    """Run the floor-over-N groups and the random-N time run."""
    probs = feature_probs(n_features, zipf_a)
    delta = (2.0 * init_scale**2) ** 2
    common = dict(batch=batch, lr=lr, init_scale=init_scale, init=init, seed=seed, progress=progress)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    start = time.perf_counter()
    try:
        m, ctx = int(floor["model_size"]), tuple(float(n) for n in floor["contexts"])
        ev = _eval_steps(int(floor["steps"]))
        run = train_fresh(m, probs, steps=int(floor["steps"]), seeds=int(floor["seeds"]),
                          contexts=ctx, eval_steps=ev, desc=f"linear attention context M={m}", **common)
        modes = run.modes.reshape(len(ev), len(ctx), int(floor["seeds"]), m)  # (E, G, seeds, M)
        floor_sim = np.stack([population_loss(modes[:, g], probs, context_r(n))
                              for g, n in enumerate(ctx)])  # (G, E, seeds)
        floor_red = np.stack([population_loss(mode_exact(lr * ev, probs[:m], r=context_r(n), s0=0.0,
                                                         delta=delta), probs, context_r(n))
                              for n in ctx])  # (G, E)
        m2 = int(random["model_size"])
        dist = power_law_context(random["n_min"], random["n_max"], random["beta"])
        r_bar = context_r(*dist)
        ev2 = _eval_steps(int(random["steps"]))
        run2 = train_fresh(m2, probs, steps=int(random["steps"]), seeds=int(random["seeds"]),
                           context_dist=dist, eval_steps=ev2,
                           desc=f"linear attention random N M={m2}", **common)
        random_sim = population_loss(run2.modes, probs, r_bar)  # (E2, seeds)
        random_red = population_loss(mode_exact(lr * ev2, probs[:m2], r=r_bar, s0=0.0, delta=delta),
                                     probs, r_bar)
        r_fix = context_r(fixed_context)
        fixed_red = population_loss(mode_exact(lr * ev2, probs[:m2], r=r_fix, s0=0.0, delta=delta),
                                    probs, r_fix)
        lo_hi = half_time(np.array([WINDOW_K_LO, max(m2 // 2, WINDOW_K_LO)]), probs, lr=lr,
                          context=fixed_context, init_scale=init_scale, init=init, r=r_bar)
    finally:
        torch.set_num_threads(old)
    config = dict(floor=dict(floor, contexts=list(ctx)), random=dict(random), n_features=n_features,
                  zipf_a=zipf_a, batch=batch, lr=lr, init_scale=init_scale, init=init,
                  fixed_context=fixed_context, seed=seed)
    return ContextRun(ctx, ev, floor_sim, floor_red, ev2, random_sim, random_red, r_bar, fixed_red,
                      float(fixed_context), (float(lo_hi[0]), float(lo_hi[1])), config,
                      time.perf_counter() - start)


def context_law(*, quick: bool = False, seed: int = 0, progress: bool = False,
                settings: dict | None = None, n_boot: int = 1000) -> tuple[LawResult, ContextRun]:
    """Fit L(N) - L(inf) ~ (N+2)^-alpha at the last step, and the random-N time exponent."""
    cfg = dict(settings or (CONTEXT_QUICK if quick else CONTEXT_FULL))
    run = run_context(**cfg, seed=seed, progress=progress)
    theory = predicted_exponents(run.config["zipf_a"])
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
    floor_bar = 0.5 * (1.0 - 1.0 / run.random_r)
    t_lo, t_hi = run.window
    win = (run.random_steps >= t_lo) & (run.random_steps <= t_hi)
    steps_w = run.random_steps[win].astype(np.float64)
    b_s, blo_s, bhi_s, _ = fit_exponent(steps_w, run.random_sim.mean(axis=1)[win] - floor_bar,
                                        n_boot=n_boot, seed=seed)
    b_r = fit_exponent(steps_w, run.random_reduced[win] - floor_bar, n_boot=n_boot, seed=seed)[0]
    exps = [Exponent("context", f"L(N) - L(inf) ~ (N+2)^-alpha at step {int(run.floor_steps[-1])}",
                     a_s, lo_s, hi_s, a_r, theory["context"]),
            Exponent("time_random_context",
                     f"N ~ N^-{cfg['random']['beta']:g} per sequence: L - (1 - 1/r)/2 ~ t^-alpha",
                     b_s, blo_s, bhi_s, b_r, theory["time_random_context"])]
    details = {"contexts": [str(n) for n in run.contexts], "diff_sim": diff_sim, "diff_reduced": diff_red,
               "c_sim": c_s, "c_reduced": c_r, "random_r": run.random_r, "random_floor": floor_bar,
               "random_window": list(run.window), "config": run.config}
    return LawResult("context", "context length", exps, "linear_attention_context.png", run.wall_s,
                     details), run
