"""The size sweep of the linear-attention toy: the time, model-size and compute laws' data.

``simulate_linear_attention`` trains ``seeds`` replicas of every model size by SGD, each size to
the same stage of its last feature, and bins the loss curves; ``compare`` sets them beside the
reduced dynamics (``theory``) size by size, from which ``laws`` reads the time, model-size and
compute exponents. The model and its derivation: docs/linear_attention.md.

The loss of the sweep at a step is the mean loss of the fresh training batches (evaluated before
the update) over a log-spaced bin of steps; the reduced dynamics are averaged over the same bins.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from peakprobe.toy import ToyConfigError
from peakprobe.toy.linear_attention.config import DEFAULT
from peakprobe.toy.linear_attention.laws import fit_exponent
from peakprobe.toy.linear_attention.sim import bin_curve, log_bins, train_fresh
from peakprobe.toy.linear_attention.theory import (
    ReducedDynamics,
    asymptotic_reducible,
    context_floor,
    context_r,
    feature_probs,
    half_time,
    loss_floor,
    mode_exact,
    population_loss,
    predicted_exponents,
    reduced_dynamics,
)

__all__ = [
    "FULL",
    "QUICK",
    "LinearAttentionComparison",
    "LinearAttentionSim",
    "compare",
    "final_steps",
    "simulate_linear_attention",
    "size_steps",
]

# The size sweep behind the time, model-size and compute laws. ``steps`` is the largest size's;
# size M runs steps * (M / M_max)^(1+a) steps (at least MIN_STEPS), which takes every size to
# the same stage, ~1.8 half-learning times of its last feature, so the final losses are
# converged (model-size law) and every size passes its compute-optimal point (compute law).
QUICK = dict(model_sizes=(8, 11, 16, 23, 32), steps=4600, seeds=8)
FULL = dict(model_sizes=(8, 11, 16, 23, 32, 45, 64), steps=16000, seeds=8)
MIN_STEPS = 200
# the final loss of a size: mean population loss at FINAL_POINTS steps over the last FINAL_SPAN
FINAL_POINTS, FINAL_SPAN = 8, 0.15
# Time-exponent window: from the half-learning time of feature WINDOW_K_LO to that of feature M/2.
WINDOW_K_LO = 3
AGREE_REL = 0.05
AGREE_ALPHA = 0.05


@dataclass
class LinearAttentionSim:
    """Binned simulated loss curves: ``loss[i, r, j]`` = model size i, replica r, bin j (NaN for
    bins after size i's last step ``size_steps[i]``)."""

    model_sizes: tuple[int, ...]
    edges: np.ndarray  # (P + 1,) step bin edges, bin j = steps edges[j] .. edges[j+1]-1
    t: np.ndarray  # (P,) mean step of each bin
    loss: np.ndarray  # (len(model_sizes), seeds, P)
    config: dict
    wall_s: float
    size_steps: tuple[int, ...] = ()
    final_loss: np.ndarray | None = None  # (len(model_sizes), seeds) population loss at the end


@dataclass
class LinearAttentionComparison:
    """Simulation vs reduced dynamics: a per-size ``table`` and a ``summary`` dict."""

    simulation: LinearAttentionSim
    reduced: ReducedDynamics  # per-step loss of the reduced ODE
    reduced_binned: np.ndarray  # (len(model_sizes), P): ``reduced`` averaged over sim.edges
    asymptotic: np.ndarray  # (P,) closed-form loss above the floor, all features visible
    table: pd.DataFrame
    summary: dict = field(default_factory=dict)


def _check_config(cfg: dict) -> None:
    sizes = cfg["model_sizes"]
    if not sizes or any(int(m) < 2 for m in sizes):
        raise ToyConfigError(f"model_sizes must be integers >= 2, got {sizes}")
    if max(sizes) > cfg["n_features"]:
        raise ToyConfigError(f"model sizes {sizes} exceed n_features={cfg['n_features']}: raise n_features")
    for key in ("context", "batch", "steps", "seeds", "n_bins"):
        if not float(cfg[key]) >= 1:
            raise ToyConfigError(f"{key} must be a positive integer, got {cfg[key]}")
    if cfg["steps"] < 20:
        raise ToyConfigError(f"steps must be at least 20, got {cfg['steps']}")
    if cfg["init"] not in ("independent", "balanced"):
        raise ToyConfigError(f"init must be 'independent' or 'balanced', got {cfg['init']!r}")
    if not cfg["zipf_a"] > 0 or not cfg["lr"] > 0 or not cfg["init_scale"] > 0:
        raise ToyConfigError("zipf_a, lr and init_scale must be positive")


def size_steps(model_sizes: tuple[int, ...], steps: int, zipf_a: float, edges: np.ndarray,
               scale_steps: bool = True) -> tuple[int, ...]:
    """Steps of every size: steps * (M / M_max)^(1+a), at least MIN_STEPS, rounded up to a bin
    edge so that no bin is cut (all sizes run ``steps`` when ``scale_steps`` is False)."""
    top = max(model_sizes)
    out = []
    for m in model_sizes:
        want = steps * (m / top) ** (1.0 + zipf_a) if scale_steps else steps
        want = min(max(int(math.ceil(want)), MIN_STEPS), steps)
        out.append(int(edges[min(np.searchsorted(edges, want), len(edges) - 1)]))
    return tuple(out)


def simulate_linear_attention(
    *,
    model_sizes: tuple[int, ...] = QUICK["model_sizes"],
    steps: int = QUICK["steps"],
    seeds: int = QUICK["seeds"],
    n_features: int = DEFAULT.n_features,
    zipf_a: float = DEFAULT.zipf_a,
    context: float = DEFAULT.context,
    batch: int = DEFAULT.batch,
    lr: float = DEFAULT.lr,
    init_scale: float = DEFAULT.init_scale,
    init: str = DEFAULT.init,
    n_bins: int = DEFAULT.n_bins,
    scale_steps: bool = True,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = 1,
) -> LinearAttentionSim:
    """Train ``seeds`` replicas of the LSA for every model size by SGD and bin the loss curves.

    ``steps`` is the largest size's; smaller sizes run fewer (``size_steps``) unless
    ``scale_steps`` is False. ``init="balanced"`` starts W_Q = W_K (the exact Riccati case).
    ``threads`` caps torch's intra-op threads during the run (restored afterwards).
    """
    cfg = dict(model_sizes=tuple(int(m) for m in model_sizes), steps=int(steps), seeds=int(seeds),
               n_features=int(n_features), zipf_a=float(zipf_a), context=float(context),
               batch=int(batch), lr=float(lr), init_scale=float(init_scale), init=init,
               n_bins=int(n_bins), seed=int(seed), scale_steps=bool(scale_steps))
    _check_config(cfg)
    edges = log_bins(cfg["steps"], cfg["n_bins"])
    per_size = size_steps(cfg["model_sizes"], cfg["steps"], cfg["zipf_a"], edges, scale_steps)
    probs = feature_probs(cfg["n_features"], cfg["zipf_a"])
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        start = time.perf_counter()
        binned = np.full((len(per_size), cfg["seeds"], len(edges) - 1), np.nan)
        final = np.empty((len(per_size), cfg["seeds"]))
        for i, (m, n_steps) in enumerate(zip(cfg["model_sizes"], per_size, strict=True)):
            run = train_fresh(m, probs, steps=n_steps, seeds=cfg["seeds"], batch=cfg["batch"],
                              lr=cfg["lr"], init_scale=cfg["init_scale"], init=cfg["init"],
                              contexts=(cfg["context"],), eval_steps=final_steps(n_steps),
                              seed=cfg["seed"], progress=progress, desc=f"linear attention M={m}")
            own = edges[edges <= n_steps]
            binned[i, :, : len(own) - 1] = bin_curve(run.loss, own)[1]
            # end point of the size law: exact population loss of the weights, averaged over the
            # last steps (the SGD fluctuation of the fastest mode makes one snapshot noisy)
            final[i] = population_loss(run.modes, probs, context_r(cfg["context"])).mean(axis=0)
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(old_threads)
    t = bin_curve(np.zeros((1, int(edges[-1]))), edges)[0]
    cfg["model_sizes"] = list(cfg["model_sizes"])
    cfg["size_steps"] = list(per_size)
    return LinearAttentionSim(tuple(cfg["model_sizes"]), edges, t, binned, cfg, wall, per_size, final)


def _fit_decay(t: np.ndarray, y: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float, float]:
    """Exponent of y ~ c t^-alpha (as alpha, lo, hi, c) via peakprobe.fits.fit_power_law."""
    return fit_exponent(t, y, n_boot=n_boot, seed=seed)


def final_steps(steps: int) -> np.ndarray:
    """The FINAL_POINTS steps over the last FINAL_SPAN of a run at which the final loss is taken."""
    return np.unique(np.round(np.linspace((1.0 - FINAL_SPAN) * steps, steps, FINAL_POINTS)).astype(np.int64))


def _start(init_scale: float, init: str) -> dict:
    """Typical start of every mode: s = 0 and Delta = 4 sigma0^4 (independent), or s = sigma0^2
    and Delta = 0 (balanced)."""
    if init == "balanced":
        return dict(s0=init_scale**2, delta=0.0)
    return dict(s0=0.0, delta=(2.0 * init_scale**2) ** 2)


def _last_finite(v: np.ndarray) -> float:
    ok = np.flatnonzero(np.isfinite(v))
    return float(v[ok[-1]]) if len(ok) else float("nan")


def compare(sim: LinearAttentionSim, reduced: ReducedDynamics | None = None, *,
            n_boot: int = 1000, seed: int = 0) -> LinearAttentionComparison:
    """Table of simulation vs reduced dynamics per model size, and the exponent summary.

    Window for size M: steps between the half-learning times of feature 3 and feature M/2
    (``half_time``). Time exponent: fit of (loss - 1/(N+2)) ~ t^-alpha over the window, for the
    simulation mean and for the reduced dynamics alike. Model-size exponent: fit of the final
    (loss - 1/(N+2)) against M. ``max_rel_dev`` = max over the window of |sim / ODE - 1|.
    """
    cfg = sim.config
    if reduced is None:
        reduced = reduced_dynamics(**{k: cfg[k] for k in ("n_features", "zipf_a", "context", "lr",
                                                          "steps", "init_scale", "init")},
                                   model_sizes=tuple(sim.model_sizes), method="exact")
    t_red, red_binned = bin_curve(reduced.loss, sim.edges)  # (sizes, P)
    red_binned = np.where(np.isfinite(sim.loss[:, 0]), red_binned, np.nan)  # same bins as the sim
    probs = feature_probs(cfg["n_features"], cfg["zipf_a"])
    floor = context_floor(cfg["context"])
    theory = predicted_exponents(cfg["zipf_a"])
    rows = []
    for i, m in enumerate(sim.model_sizes):
        sim_mean = sim.loss[i].mean(axis=0)  # (P,)
        t_lo, t_hi = (float(x) for x in half_time(np.array([WINDOW_K_LO, max(m // 2, WINDOW_K_LO)]),
                                                   probs, lr=cfg["lr"], context=cfg["context"],
                                                   init_scale=cfg["init_scale"], init=cfg["init"]))
        win = (sim.t >= t_lo) & (sim.t <= t_hi) & np.isfinite(sim_mean)
        row = dict(model_size=m, steps=int(sim.size_steps[i]) if sim.size_steps else cfg["steps"],
                   t_min=t_lo, t_max=t_hi, n_points=int(win.sum()),
                   max_rel_dev=float("nan"), time_alpha_sim=float("nan"),
                   time_alpha_sim_lo=float("nan"), time_alpha_sim_hi=float("nan"),
                   time_alpha_reduced=float("nan"), time_alpha_theory=theory["time"])
        if win.sum() >= 4:  # peakprobe.fits needs 4 points
            row["max_rel_dev"] = float(np.max(np.abs(sim_mean[win] / red_binned[i, win] - 1.0)))
            a, lo, hi, _ = _fit_decay(sim.t[win], sim_mean[win] - floor, n_boot, seed)
            row.update(time_alpha_sim=a, time_alpha_sim_lo=lo, time_alpha_sim_hi=hi)
            row["time_alpha_reduced"] = _fit_decay(t_red[win], red_binned[i, win] - floor, n_boot, seed)[0]
        n_steps = int(sim.size_steps[i]) if sim.size_steps else cfg["steps"]
        if sim.final_loss is not None:
            final_sim = float(sim.final_loss[i].mean())
            modes = mode_exact(cfg["lr"] * final_steps(n_steps), probs[:m],
                               r=context_r(cfg["context"]), **_start(cfg["init_scale"], cfg["init"]))
            final_red = float(population_loss(modes, probs, context_r(cfg["context"])).mean())
        else:
            final_sim, final_red = _last_finite(sim_mean), _last_finite(red_binned[i])
        row.update(final_loss_sim=final_sim, final_loss_reduced=final_red,
                   final_reducible_sim=final_sim - floor, final_reducible_reduced=final_red - floor,
                   converged_reducible=float(loss_floor(m, probs, cfg["context"]) - floor))
        rows.append(row)
    table = pd.DataFrame(rows)
    summary = _summarize(table, theory, floor, n_boot, seed)
    asymptotic = asymptotic_reducible(sim.t, probs, cfg["zipf_a"], lr=cfg["lr"],
                                      context=cfg["context"], init_scale=cfg["init_scale"],
                                      init=cfg["init"])
    return LinearAttentionComparison(sim, reduced, red_binned, asymptotic, table, summary)


def _summarize(table: pd.DataFrame, theory: dict, floor: float, n_boot: int, seed: int) -> dict:
    fitted = table.dropna(subset=["time_alpha_sim"])
    agree = fitted[(fitted["max_rel_dev"] <= AGREE_REL)
                   & ((fitted["time_alpha_sim"] - fitted["time_alpha_reduced"]).abs() <= AGREE_ALPHA)]
    sizes = table["model_size"].to_numpy(dtype=np.float64)
    size = {"alpha_theory": theory["model_size"]}
    if len(sizes) >= 4:  # peakprobe.fits needs 4 points
        a_s, lo_s, hi_s, c_s = _fit_decay(sizes, table["final_reducible_sim"].to_numpy(), n_boot, seed)
        a_r, _, _, c_r = _fit_decay(sizes, table["final_reducible_reduced"].to_numpy(), n_boot, seed)
        a_c, _, _, _ = _fit_decay(sizes, table["converged_reducible"].to_numpy(), n_boot, seed)
        size.update(alpha_sim=a_s, alpha_sim_lo=lo_s, alpha_sim_hi=hi_s, c_sim=c_s,
                    alpha_reduced=a_r, c_reduced=c_r, alpha_converged=a_c)
    largest = fitted.iloc[-1] if len(fitted) else None
    return {
        "context_floor": floor,
        "theory": theory,
        "time": None if largest is None else {
            "model_size": int(largest["model_size"]),
            "alpha_sim": float(largest["time_alpha_sim"]),
            "alpha_sim_lo": float(largest["time_alpha_sim_lo"]),
            "alpha_sim_hi": float(largest["time_alpha_sim_hi"]),
            "alpha_reduced": float(largest["time_alpha_reduced"]),
            "alpha_theory": theory["time"],
        },
        "size": size,
        "n_sizes_agree": int(len(agree)),
        "acceptance": bool(len(agree) >= 3),
        "criteria": f"max |sim/ODE - 1| <= {AGREE_REL} over the window and "
                    f"|alpha_sim - alpha_ODE| <= {AGREE_ALPHA}, for >= 3 model sizes",
    }
