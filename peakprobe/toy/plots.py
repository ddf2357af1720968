"""Figures for the toy models (matplotlib's Agg canvas); drawing only, no computation.

``plot_peaked`` draws one peaked-softmax run (loss, ||W||_F and logit std against step, log-log,
with the fitted power laws over the fit window); ``plot_linear_attention`` draws the simulated
linear-attention loss curves against the reduced dynamics for every model size, and the final
loss against model size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from .. import vocab
from ..probes.gaussian_entropy import peaked_threshold

__all__ = ["plot_linear_attention", "plot_peaked"]


def _subplots(ncols: int, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A figure on its own Agg canvas (no pyplot, no global backend switch)."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_peaked(run: Any, summary: dict, out_dir: Path) -> list[Path]:
    """Write ``peaked_<optimizer>.png``: loss and logit growth with their fitted power laws.

    ``run`` is a ``peaked_softmax.PeakedRun`` (steps, loss, w_norm, logit_std, optimizer)."""
    out_dir = Path(out_dir)
    t = run.steps.astype(float)
    t0, t1 = summary["window"]["t_min"], summary["window"]["t_max"]
    tw = np.geomspace(t0, t1, 50)
    fig, (ax_l, ax_g) = _subplots(2, (10, 4))

    ax_l.loglog(t, run.loss, "o", ms=3, color="C0", label="KL(teacher||student)")
    a = summary["loss_alpha"]
    ax_l.loglog(tw, summary["loss_c"] * tw ** (-a), "-", color="k",
                label=f"fit: t^-{a:.3f} [{summary['loss_alpha_lo']:.3f}, {summary['loss_alpha_hi']:.3f}]")
    ax_l.axvspan(t0, t1, color="0.9", zorder=0)
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss")
    ax_l.set_title(f"{run.optimizer}: loss")
    ax_l.legend(fontsize=8)

    for key, color, label in (("w_norm", "C1", "||W||_F"), (vocab.LOGIT_STD, "C2", "logit std")):
        alpha = summary[f"{key}_alpha"]
        ax_g.loglog(t, getattr(run, key), "o", ms=3, color=color, label=f"{label}: fit t^{alpha:.3f}")
        ax_g.loglog(tw, summary[f"{key}_c"] * tw ** alpha, "-", color="k", lw=1)
    ax_g.axhline(peaked_threshold(run.config["n"]), ls=":", color="0.4", label="sqrt(2 ln n)")
    ax_g.axvspan(t0, t1, color="0.9", zorder=0)
    ax_g.set_xlabel("step")
    ax_g.set_title(f"{run.optimizer}: growth (window shaded)")
    ax_g.legend(fontsize=8)
    return [_save(fig, out_dir / f"peaked_{run.optimizer}.png")]


def plot_linear_attention(comparison: Any, out_dir: Path) -> list[Path]:
    """``comparison`` is a ``linear_attention.LinearAttentionComparison``. Write ``linear_attention_curves.png`` (loss vs step per model size, simulation mean with
    its 10-90% seed spread against the reduced dynamics, fit windows dotted; and the loss above
    the context floor with the predicted t^-(a/(1+a))) and ``linear_attention_sizes.png``
    (final loss above the context floor against model size)."""
    out_dir = Path(out_dir)
    sim, red = comparison.simulation, comparison.reduced_binned
    floor = comparison.summary["context_floor"]
    theory = comparison.summary["theory"]["time"]
    fig, (ax, ax_r) = _subplots(2, (12, 4.5))
    for i, m in enumerate(sim.model_sizes):
        color = f"C{i}"
        mean = sim.loss[i].mean(axis=0)  # NaN after this size's last step
        lo, hi = np.quantile(sim.loss[i], [0.1, 0.9], axis=0)
        ax.fill_between(sim.t, lo, hi, color=color, alpha=0.2, lw=0)
        ax.loglog(sim.t, mean, "o", ms=3, color=color, label=f"M = {m}")
        ax.loglog(sim.t, red[i], "-", color=color, lw=1.2)
        ax_r.loglog(sim.t, mean - floor, "o", ms=3, color=color, label=f"M = {m}")
        ax_r.loglog(sim.t, red[i] - floor, "-", color=color, lw=1.2)
        row = comparison.table.iloc[i]
        if row["n_points"] >= 4:
            for a in (ax, ax_r):
                a.axvline(row["t_min"], color=color, ls=":", lw=0.8)
                a.axvline(row["t_max"], color=color, ls=":", lw=0.8)
    late = sim.t >= 10
    ax_r.loglog(sim.t[late], comparison.asymptotic[late], "--", color="k", lw=1,
                label=f"closed form, M = inf: ~ t^-{theory:.3f} = t^-(a/(1+a))")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"linear attention, a = {sim.config['zipf_a']:g}: simulation (dots, 10-90% band) "
                 "vs reduced dynamics (lines)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax_r.set_xlabel("step")
    ax_r.set_ylabel(f"loss - context floor 1/(N+2) = {floor:.4f}")
    ax_r.set_title("loss above the context floor (dots: simulation, lines: ODE)")
    ax_r.legend(fontsize=7)
    paths = [_save(fig, out_dir / "linear_attention_curves.png")]

    fig, ax = _subplots(1, (5.5, 4.5))
    sizes = np.asarray(sim.model_sizes, dtype=float)
    table = comparison.table
    ax.loglog(sizes, table["final_reducible_sim"], "o", label="simulation")
    ax.loglog(sizes, table["final_reducible_reduced"], "s", mfc="none", label="reduced ODE")
    ax.loglog(sizes, table["converged_reducible"], "+", color="k", label="closed form, converged")
    s = comparison.summary["size"]
    if "alpha_sim" in s:
        ax.loglog(sizes, s["c_sim"] * sizes ** (-s["alpha_sim"]), "-", color="k", lw=1,
                  label=f"fit: M^-{s['alpha_sim']:.3f} [{s['alpha_sim_lo']:.3f}, "
                        f"{s['alpha_sim_hi']:.3f}], ODE {s['alpha_reduced']:.3f}, "
                        f"predicted a = {sim.config['zipf_a']:g}")
    ax.set_title("final loss at ~1.8 half-learning times of feature M", fontsize=9)
    ax.set_xlabel("model size M (key/query width)")
    ax.set_ylabel("final loss - context floor")
    ax.legend(fontsize=7, loc="lower left")
    paths.append(_save(fig, out_dir / "linear_attention_sizes.png"))
    return paths
