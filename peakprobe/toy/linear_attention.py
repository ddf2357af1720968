"""Simulated training of the solvable linear self-attention toy, and its comparison with theory.

The toy follows the setting of Lyu, Wang & Zhu, "A Solvable Attention for Neural Scaling Laws"
(ICLR 2025) in our own concrete form (docs/linear_attention.md): multitask sparse feature
regression learned in context by a softmax-free linear self-attention. Feature k (task k) has
frequency p_k ~ k^-(1+a). A sequence of task k is N context tokens x_i = g_i e_k with labels
y_i = w g_i and a query x_q = g_q e_k with target y_q = w g_q (g ~ N(0, 1), w = +-1 drawn per
sequence, so w must be read from the context). A model of size M embeds the first M features
and predicts

    y_hat = (1/N) sum_i y_i <W_K x_i, W_Q x_q> = <W_K h, W_Q x_q>,   h = (1/N) sum_i y_i x_i,

with W_K, W_Q in R^{M x M} initialised N(0, sigma0^2 / M). Training is plain SGD on
0.5 (y_q - y_hat)^2 with fresh batches, ``seeds`` independent replicas run side by side.
Tokens are scaled one-hot vectors, so W_K h is one column of W_K times a scalar; the code
gathers that column instead of multiplying by a mostly-zero vector (same function, see
``lsa_predict_dense`` and the tests).

The loss reported at a step is the mean loss of the fresh training batches (evaluated before
the update) over a log-spaced bin of steps; the reduced dynamics are averaged over the same bins.

Public names: ``LinearAttentionSim``, ``LinearAttentionComparison``,
``simulate_linear_attention``, ``compare``, ``plot_linear_attention``, ``cli_linear``,
``lsa_predict_dense``, ``lsa_step``, ``QUICK``, ``FULL``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from peakprobe.results import write_json
from peakprobe.toy import ToyConfigError
from peakprobe.toy.linear_attention_theory import (
    ReducedDynamics,
    asymptotic_reducible,
    context_floor,
    feature_probs,
    half_time,
    loss_floor,
    predicted_exponents,
    reduced_dynamics,
)
from peakprobe.toy.plots import plot_linear_attention

__all__ = [
    "FULL",
    "QUICK",
    "LinearAttentionComparison",
    "LinearAttentionSim",
    "ToyConfigError",
    "bin_curve",
    "cli_linear",
    "format_linear",
    "compare",
    "log_bins",
    "lsa_predict_dense",
    "lsa_step",
    "plot_linear_attention",
    "reduced_dynamics",
    "simulate_linear_attention",
]

# Settings of ``cli_linear``. QUICK fits the tests (M = 64 is still learning at its end, so its
# model-size exponent is the one at a fixed time); FULL trains every size to convergence. M = 8
# has no time-fit window (features 3..4 only); it serves the model-size fit (4 sizes needed).
QUICK = dict(model_sizes=(8, 16, 32, 64), steps=3000, seeds=8)
FULL = dict(model_sizes=(8, 16, 32, 64), steps=16000, seeds=8)
BASE = dict(n_features=4096, zipf_a=0.8, context=32, batch=512, lr=1.0, init_scale=0.1,
            init="independent", n_bins=30)
# Time-exponent window: from the half-learning time of feature WINDOW_K_LO to that of feature M/2.
WINDOW_K_LO = 3
AGREE_REL = 0.05
AGREE_ALPHA = 0.05


@dataclass
class LinearAttentionSim:
    """Binned simulated loss curves: ``loss[i, r, j]`` = model size i, replica r, bin j."""

    model_sizes: tuple[int, ...]
    edges: np.ndarray  # (P + 1,) step bin edges, bin j = steps edges[j] .. edges[j+1]-1
    t: np.ndarray  # (P,) mean step of each bin
    loss: np.ndarray  # (len(model_sizes), seeds, P)
    config: dict
    wall_s: float


@dataclass
class LinearAttentionComparison:
    """Simulation vs reduced dynamics: a per-size ``table`` and a ``summary`` dict."""

    simulation: LinearAttentionSim
    reduced: ReducedDynamics  # per-step loss of the reduced ODE
    reduced_binned: np.ndarray  # (len(model_sizes), P): ``reduced`` averaged over sim.edges
    asymptotic: np.ndarray  # (P,) closed-form loss above the floor, all features visible
    table: pd.DataFrame
    summary: dict = field(default_factory=dict)


def log_bins(steps: int, n_bins: int) -> np.ndarray:
    """Log-spaced integer bin edges over steps 1..steps-1 (step 0, the start, is left out)."""
    raw = np.round(np.logspace(0.0, math.log10(steps), n_bins + 1)).astype(np.int64)
    return np.unique(np.clip(raw, 1, steps))


def bin_curve(values: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values[..., step]`` and of the step index over each bin: (t (P,), v (..., P))."""
    steps = np.arange(values.shape[-1], dtype=np.float64)
    t = np.array([steps[a:b].mean() for a, b in zip(edges[:-1], edges[1:], strict=True)])
    v = np.stack([values[..., a:b].mean(axis=-1) for a, b in zip(edges[:-1], edges[1:], strict=True)],
                 axis=-1)
    return t, v


def lsa_predict_dense(w_k: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor,
                      x_q: torch.Tensor) -> torch.Tensor:
    """Reference linear self-attention readout <W_K h, W_Q x_q> on dense vectors.

    w_k, w_q (S, M, M); h, x_q (S, B, M) -> (S, B).
    """
    keys = torch.bmm(h, w_k.transpose(1, 2))  # (S, B, M)
    queries = torch.bmm(x_q, w_q.transpose(1, 2))  # (S, B, M)
    return (keys * queries).sum(-1)


def lsa_step(w_k: torch.Tensor, w_q: torch.Tensor, feat: torch.Tensor, h_val: torch.Tensor,
             q_val: torch.Tensor, y_q: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step, in place, on the batch-mean of 0.5 (y_q - y_hat)^2; returns the loss (S,).

    A token is ``value * e_feat``; ``feat`` (S, B) in [0, M) for visible features, -1 for
    features the model does not embed (prediction 0, no gradient). h_val, q_val, y_q: (S, B).
    """
    s, m, _ = w_k.shape
    batch = feat.shape[1]
    visible = feat >= 0  # (S, B)
    idx = feat.clamp(min=0)  # (S, B)
    cols = idx.unsqueeze(1).expand(s, m, batch)  # (S, M, B)
    k_col = w_k.gather(2, cols)  # (S, M, B) = W_K e_feat
    q_col = w_q.gather(2, cols)  # (S, M, B) = W_Q e_feat
    y_hat = h_val * q_val * (k_col * q_col).sum(1) * visible  # (S, B)
    err = y_q - y_hat  # (S, B)
    loss = 0.5 * (err * err).mean(1)  # (S,)
    # d loss / d W_K[:, j] = -sum_{b: feat_b = j} err_b h_b q_b W_Q[:, j] / B (and K <-> Q)
    coef = torch.zeros(s, m, dtype=w_k.dtype, device=w_k.device)  # (S, M)
    coef.scatter_add_(1, idx, -(err * h_val * q_val * visible) / batch)
    grad_k = w_q * coef.unsqueeze(1)  # (S, M, M)
    grad_q = w_k * coef.unsqueeze(1)
    w_k.sub_(lr * grad_k)
    w_q.sub_(lr * grad_q)
    return loss


def _check_config(cfg: dict) -> None:
    sizes = cfg["model_sizes"]
    if not sizes or any(int(m) < 2 for m in sizes):
        raise ToyConfigError(f"model_sizes must be integers >= 2, got {sizes}")
    if max(sizes) > cfg["n_features"]:
        raise ToyConfigError(f"model sizes {sizes} exceed n_features={cfg['n_features']}: raise n_features")
    for key in ("context", "batch", "steps", "seeds", "n_bins"):
        if int(cfg[key]) < 1:
            raise ToyConfigError(f"{key} must be a positive integer, got {cfg[key]}")
    if cfg["steps"] < 20:
        raise ToyConfigError(f"steps must be at least 20, got {cfg['steps']}")
    if cfg["init"] not in ("independent", "balanced"):
        raise ToyConfigError(f"init must be 'independent' or 'balanced', got {cfg['init']!r}")
    if not cfg["zipf_a"] > 0 or not cfg["lr"] > 0 or not cfg["init_scale"] > 0:
        raise ToyConfigError("zipf_a, lr and init_scale must be positive")


def simulate_linear_attention(
    *,
    model_sizes: tuple[int, ...] = QUICK["model_sizes"],
    steps: int = QUICK["steps"],
    seeds: int = QUICK["seeds"],
    n_features: int = BASE["n_features"],
    zipf_a: float = BASE["zipf_a"],
    context: int = BASE["context"],
    batch: int = BASE["batch"],
    lr: float = BASE["lr"],
    init_scale: float = BASE["init_scale"],
    init: str = BASE["init"],
    n_bins: int = BASE["n_bins"],
    seed: int = 0,
    progress: bool = True,
    threads: int | None = 1,
) -> LinearAttentionSim:
    """Train ``seeds`` replicas of the LSA for every model size by SGD and bin the loss curves.

    ``init="balanced"`` starts W_Q = W_K (the exact Riccati case). ``threads`` caps torch's
    intra-op threads during the run (restored afterwards); ``None`` leaves them alone.
    """
    cfg = dict(model_sizes=tuple(int(m) for m in model_sizes), steps=int(steps), seeds=int(seeds),
               n_features=int(n_features), zipf_a=float(zipf_a), context=int(context),
               batch=int(batch), lr=float(lr), init_scale=float(init_scale), init=init,
               n_bins=int(n_bins), seed=int(seed))
    _check_config(cfg)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        start = time.perf_counter()
        curves = np.stack([_simulate_size(cfg, m, progress) for m in cfg["model_sizes"]])
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(old_threads)
    edges = log_bins(cfg["steps"], cfg["n_bins"])
    t, binned = bin_curve(curves, edges)  # (sizes, seeds, P)
    cfg["model_sizes"] = list(cfg["model_sizes"])
    return LinearAttentionSim(tuple(cfg["model_sizes"]), edges, t, binned, cfg, wall)


def _simulate_size(cfg: dict, m: int, progress: bool) -> np.ndarray:
    """Per-step training loss (seeds, steps) of ``seeds`` replicas of the size-m model."""
    s, batch, n_ctx = cfg["seeds"], cfg["batch"], cfg["context"]
    gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + m)
    scale = cfg["init_scale"] / math.sqrt(m)
    w_k = torch.randn(s, m, m, generator=gen) * scale  # (S, M, M)
    w_q = w_k.clone() if cfg["init"] == "balanced" else torch.randn(s, m, m, generator=gen) * scale
    cdf = torch.from_numpy(np.cumsum(feature_probs(cfg["n_features"], cfg["zipf_a"])))
    losses = torch.empty(cfg["steps"], s)
    for step in tqdm(range(cfg["steps"]), disable=not progress, desc=f"linear attention M={m}",
                     mininterval=1.0):
        u = torch.rand(s, batch, generator=gen, dtype=torch.float64)
        task = torch.searchsorted(cdf, u).clamp_(max=cfg["n_features"] - 1)  # (S, B), 0-based
        sign = torch.randint(0, 2, (s, batch), generator=gen).float() * 2.0 - 1.0  # (S, B)
        g_ctx = torch.randn(s, batch, n_ctx, generator=gen)  # (S, B, N) token magnitudes
        g_q = torch.randn(s, batch, generator=gen)  # (S, B)
        y_ctx = sign.unsqueeze(-1) * g_ctx  # (S, B, N) labels
        h_val = (y_ctx * g_ctx).mean(-1)  # (S, B): h = h_val * e_task
        feat = torch.where(task < m, task, torch.full_like(task, -1))
        losses[step] = lsa_step(w_k, w_q, feat, h_val, g_q, sign * g_q, cfg["lr"])
    return losses.T.numpy().astype(np.float64)


def _fit_decay(t: np.ndarray, y: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float, float]:
    """Exponent of y ~ c t^-alpha (as alpha, lo, hi, c) via peakprobe.fits.fit_power_law."""
    from peakprobe.fits import fit_power_law

    fit = fit_power_law(t, y, n_boot=n_boot, ci=0.9, seed=seed)
    return -float(fit.alpha), -float(fit.alpha_hi), -float(fit.alpha_lo), float(fit.c)


def compare(sim: LinearAttentionSim, reduced: ReducedDynamics | None = None, *,
            n_boot: int = 400, seed: int = 0) -> LinearAttentionComparison:
    """Table of simulation vs reduced dynamics per model size, and the exponent summary.

    Window for size M: steps between the half-learning times of feature 3 and feature M/2
    (``half_time``). Time exponent: fit of (loss - 1/(N+2)) ~ t^-alpha over the window, for the
    simulation mean and for the reduced ODE alike. Model-size exponent: fit of the final
    (loss - 1/(N+2)) against M. ``max_rel_dev`` = max over the window of |sim / ODE - 1|.
    """
    cfg = sim.config
    if reduced is None:
        reduced = reduced_dynamics(**{k: cfg[k] for k in ("n_features", "zipf_a", "context", "lr",
                                                          "steps", "init_scale", "init")},
                                   model_sizes=tuple(sim.model_sizes))
    t_red, red_binned = bin_curve(reduced.loss, sim.edges)  # (sizes, P)
    probs = feature_probs(cfg["n_features"], cfg["zipf_a"])
    floor = context_floor(cfg["context"])
    theory = predicted_exponents(cfg["zipf_a"])
    rows = []
    for i, m in enumerate(sim.model_sizes):
        sim_mean = sim.loss[i].mean(axis=0)  # (P,)
        t_lo, t_hi = (float(x) for x in half_time(np.array([WINDOW_K_LO, max(m // 2, WINDOW_K_LO)]),
                                                   probs, lr=cfg["lr"], context=cfg["context"],
                                                   init_scale=cfg["init_scale"], init=cfg["init"]))
        win = (sim.t >= t_lo) & (sim.t <= t_hi)
        row = dict(model_size=m, t_min=t_lo, t_max=t_hi, n_points=int(win.sum()),
                   max_rel_dev=float("nan"), time_alpha_sim=float("nan"),
                   time_alpha_sim_lo=float("nan"), time_alpha_sim_hi=float("nan"),
                   time_alpha_reduced=float("nan"), time_alpha_theory=theory["time"])
        if win.sum() >= 4:  # peakprobe.fits needs 4 points
            row["max_rel_dev"] = float(np.max(np.abs(sim_mean[win] / red_binned[i, win] - 1.0)))
            a, lo, hi, _ = _fit_decay(sim.t[win], sim_mean[win] - floor, n_boot, seed)
            row.update(time_alpha_sim=a, time_alpha_sim_lo=lo, time_alpha_sim_hi=hi)
            row["time_alpha_reduced"] = _fit_decay(t_red[win], red_binned[i, win] - floor, n_boot, seed)[0]
        row.update(final_loss_sim=float(sim_mean[-1]), final_loss_reduced=float(red_binned[i, -1]),
                   final_reducible_sim=float(sim_mean[-1] - floor),
                   final_reducible_reduced=float(red_binned[i, -1] - floor),
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


def cli_linear(out_dir: Path, *, quick: bool = False, seed: int = 0, progress: bool = True) -> dict:
    """``peakprobe toy linear``: simulate, solve the reduced dynamics, compare, plot; write plots,
    ``linear_attention_table.csv`` and ``summary.json`` into ``out_dir``; return the summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {**BASE, **(QUICK if quick else FULL)}
    sim = simulate_linear_attention(**settings, seed=seed, progress=progress)
    comparison = compare(sim, seed=seed)
    paths = plot_linear_attention(comparison, out_dir)
    comparison.table.to_csv(out_dir / "linear_attention_table.csv", index=False)
    summary = {
        "toy": "linear_attention",
        "quick": bool(quick),
        "config": sim.config,
        "wall_s": sim.wall_s,
        **comparison.summary,
        "table": comparison.table.to_dict(orient="records"),
        "curves": {"t": sim.t.tolist(),
                   "sim_mean": sim.loss.mean(axis=1).tolist(),
                   "reduced": comparison.reduced_binned.tolist()},
        "plots": [p.name for p in paths],
    }
    write_json(out_dir / "summary.json", summary)
    return summary


def format_linear(summary: dict) -> str:
    """What ``peakprobe toy linear`` prints: the time exponent against the solved dynamics and
    the closed form, the size exponent, and whether simulation and ODE agree."""
    lines = [f"linear attention (a = {summary['config']['zipf_a']:g}): "
             f"{summary['n_sizes_agree']} model sizes agree with the reduced dynamics "
             f"({summary['criteria']}): {'yes' if summary['acceptance'] else 'no'}"]
    t = summary["time"]
    if t is not None:
        lines.append(
            f"  time exponent, M = {t['model_size']}: simulation {t['alpha_sim']:.3f} "
            f"[{t['alpha_sim_lo']:.3f}, {t['alpha_sim_hi']:.3f}] (90% CI), reduced ODE "
            f"{t['alpha_reduced']:.3f}, closed form a/(1+a) = {t['alpha_theory']:.3f} "
            "(set by the data spectrum, not by 1/3)")
    size = summary["size"]
    if "alpha_sim" in size:
        lines.append(f"  size exponent: simulation {size['alpha_sim']:.3f} "
                     f"[{size['alpha_sim_lo']:.3f}, {size['alpha_sim_hi']:.3f}], reduced ODE "
                     f"{size['alpha_reduced']:.3f}, theory {size['alpha_theory']:.3f}")
    return "\n".join(lines)
