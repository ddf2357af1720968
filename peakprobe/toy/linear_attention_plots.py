"""Figures of the compute, data-size and context-length laws of the linear-attention toy.

Drawing only (matplotlib's Agg canvas via ``plots``); the time and model-size figures are
``plots.plot_linear_attention``. Each figure shows the simulation (dots) beside the model's
reduced dynamics (lines) and the fitted law with its predicted exponent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from peakprobe.toy.linear_attention_laws import LawResult
from peakprobe.toy.plots import _save, _subplots

__all__ = ["plot_compute", "plot_context", "plot_data"]


def _label(e: Any) -> str:
    return (f"fit {e.fitted:.3f} [{e.lo:.3f}, {e.hi:.3f}], reduced {e.reduced:.3f}, "
            f"predicted {e.predicted:.3f}")


def plot_compute(comparison: Any, law: LawResult, data: dict, out_dir: Path) -> Path:
    """``linear_attention_compute.png``: loss above the floor against C = M x steps for every
    size with the frontier and its fit; the compute-optimal size against C."""
    sim = comparison.simulation
    fig, (ax, ax_m) = _subplots(2, (12, 4.5))
    for i, m in enumerate(sim.model_sizes):
        c = m * sim.t
        ax.loglog(c, data["curves_sim"][i], "o", ms=2.5, color=f"C{i}", label=f"M = {m}")
        ax.loglog(c, data["curves_reduced"][i], "-", lw=1, color=f"C{i}")
    front, fit = data["fronts"]["sim"], data["fits"]["sim"]
    ax.loglog(front.compute, front.loss, "-", color="k", lw=2, alpha=0.35, label="frontier (simulation)")
    e_loss, e_size = law.exponents
    if np.isfinite(e_loss.fitted):
        cw = np.asarray(fit["c_points"])
        ax.loglog(cw, fit["loss"][3] * cw ** (-e_loss.fitted), "--", color="k", lw=1.2,
                  label=f"C^-alpha: {_label(e_loss)}")
    ax.set_xlabel("compute C = M x steps")
    ax.set_ylabel("loss - 1/(N+2)")
    ax.set_title("compute frontier (dots: simulation, lines: reduced dynamics)")
    ax.legend(fontsize=7, ncol=2)
    for name, marker in (("sim", "o"), ("reduced", "s")):
        f = data["fronts"][name]
        ok = np.isfinite(f.crossings)
        ax_m.loglog(f.crossings[ok], f.mid_sizes[ok], marker, mfc="none" if name == "reduced" else None,
                    label=f"{'simulation' if name == 'sim' else 'reduced dynamics'}: crossings")
    f = data["fronts"]["sim"]
    ok = np.isfinite(f.crossings)
    if np.isfinite(e_size.fitted) and ok.sum() >= 2:
        cw = np.geomspace(f.crossings[ok].min(), f.crossings[ok].max(), 20)
        ax_m.loglog(cw, data["fits"]["sim"]["size"][3] * cw ** e_size.fitted, "-", color="k", lw=1,
                    label=f"C^alpha: {_label(e_size)}")
    ax_m.set_xlabel("compute C at which size M' overtakes M")
    ax_m.set_ylabel("sqrt(M M')")
    ax_m.set_title("compute-optimal model size")
    ax_m.legend(fontsize=7)
    return _save(fig, Path(out_dir) / law.figure)


def plot_data(run: Any, law: LawResult, out_dir: Path) -> Path:
    """``linear_attention_data.png``: population loss against tau = lr x steps for every
    training-set size D (and fresh data); final loss above the floor against D."""
    fig, (ax, ax_d) = _subplots(2, (12, 4.5))
    for i, d in enumerate(run.sizes):
        color = f"C{i % 10}"
        tau = np.maximum(run.tau[i], 0.5)
        ax.loglog(tau, run.loss_sim[i].mean(axis=1) - run.floor, "o", ms=2.5, color=color, label=f"D = {d}")
        ax.loglog(tau, run.loss_reduced[i].mean(axis=1) - run.floor, "-", lw=1, color=color)
    ax.loglog(run.fresh_tau, run.fresh_reduced - run.floor, "--", color="k", lw=1.2,
              label="fresh data (reduced dynamics)")
    if run.fresh_sim is not None:
        tau_f, loss_f = run.fresh_sim
        ax.loglog(tau_f, loss_f - run.floor, "x", ms=3, color="k", label="fresh data (SGD)")
    ax.set_xlabel("tau = lr x steps (full-batch GD: steps = epochs)")
    ax.set_ylabel("population loss - 1/(N+2)")
    ax.set_title(f"finite training sets, M = {run.config['model_size']} "
                 "(dots: simulation, lines: reduced dynamics)")
    ax.legend(fontsize=7, ncol=2)
    e = law.exponents[0]
    sizes = np.asarray(run.sizes, dtype=float)
    per_rep = np.stack([v[-1] for v in run.loss_sim]) - run.floor  # (len(sizes), replicas)
    lo, hi = np.quantile(per_rep, [0.1, 0.9], axis=1)
    ax_d.fill_between(sizes, lo, hi, color="C0", alpha=0.2, lw=0, label="10-90% of training sets")
    ax_d.loglog(sizes, law.details["final_reducible_sim"], "o", color="C0", label="simulation (mean)")
    ax_d.loglog(sizes, law.details["final_reducible_reduced"], "s", mfc="none", color="C1",
                label="reduced dynamics, same sets")
    if np.isfinite(e.fitted):
        ax_d.loglog(sizes, law.details["c_sim"] * sizes ** (-e.fitted), "-", color="k", lw=1,
                    label=f"D^-alpha: {_label(e)}")
    ax_d.set_xlabel("training sequences D")
    ax_d.set_ylabel(f"loss - 1/(N+2) at tau = {run.config['tau_per_seq']:g} D")
    ax_d.set_title("data-size law")
    ax_d.legend(fontsize=7)
    return _save(fig, Path(out_dir) / law.figure)


def plot_context(run: Any, law: LawResult, out_dir: Path) -> Path:
    """``linear_attention_context.png``: L(N) - L(inf) at the last step against N + 2; the
    loss curves for every N; the time law with N drawn per sequence."""
    fig, (ax_n, ax_c, ax_t) = _subplots(3, (16, 4.5))
    ctx = np.asarray(run.contexts)
    finite = np.isfinite(ctx)
    x = ctx[finite] + 2.0
    e_n, e_t = law.exponents
    ax_n.loglog(x, law.details["diff_sim"], "o", label="simulation (mean over seeds)")
    ax_n.loglog(x, law.details["diff_reduced"], "s", mfc="none", label="reduced dynamics")
    if np.isfinite(e_n.fitted):
        ax_n.loglog(x, law.details["c_sim"] * x ** (-e_n.fitted), "-", color="k", lw=1,
                    label=f"(N+2)^-alpha: {_label(e_n)}")
    ax_n.set_xlabel("N + 2")
    ax_n.set_ylabel(f"L(N) - L(inf) at step {int(run.floor_steps[-1])}")
    ax_n.set_title(f"context floor, M = {run.config['floor']['model_size']}")
    ax_n.legend(fontsize=7)
    steps = np.maximum(run.floor_steps, 0.5)
    for g, n in enumerate(ctx):
        color = f"C{g % 10}"
        ax_c.loglog(steps, run.floor_sim[g].mean(axis=1), "o", ms=2.5, color=color, label=f"N = {n:g}")
        ax_c.loglog(steps, run.floor_reduced[g], "-", lw=1, color=color)
    ax_c.set_xlabel("step")
    ax_c.set_ylabel("population loss")
    ax_c.set_title("loss curves per context length (dots: sim, lines: reduced)")
    ax_c.legend(fontsize=7, ncol=2)
    floor_bar = law.details["random_floor"]
    t = np.maximum(run.random_steps, 0.5)
    ax_t.loglog(t, run.random_sim.mean(axis=1) - floor_bar, "o", ms=3, color="C0",
                label="N drawn per sequence: simulation")
    ax_t.loglog(t, run.random_reduced - floor_bar, "-", color="C0", lw=1.2, label="reduced dynamics")
    fix_floor = 0.5 * (1.0 - run.fixed_context / (run.fixed_context + 2.0))
    ax_t.loglog(t, run.fixed_reduced - fix_floor, ":", color="C1", lw=1.2,
                label=f"N = {run.fixed_context:g} fixed (reduced)")
    for v in run.window:
        ax_t.axvline(v, color="0.5", ls=":", lw=0.8)
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("loss above its floor")
    ax_t.set_title(f"time law, N ~ N^-{run.config['random']['beta']:g}: {_label(e_t)}", fontsize=8)
    ax_t.legend(fontsize=7)
    return _save(fig, Path(out_dir) / law.figure)
