"""Figures of the linear-attention toy's laws, one per law; drawing only.

``plot_linear_attention`` draws the size sweep (time and model-size laws), ``plot_compute``,
``plot_data`` and ``plot_context`` the other three. Each figure shows the simulation (dots)
beside the model's reduced dynamics (lines) and the fitted law with its predicted exponent;
the canvas helpers are ``peakprobe.toy.plots``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from peakprobe.toy.linear_attention.laws import LawResult
from peakprobe.toy.plots import save_figure, subplots

__all__ = ["plot_compute", "plot_context", "plot_data", "plot_linear_attention"]


def _label(e: Any) -> str:
    return (f"fit {e.fitted:.3f} [{e.lo:.3f}, {e.hi:.3f}], reduced {e.reduced:.3f}, "
            f"predicted {e.predicted:.3f}")


def plot_compute(comparison: Any, law: LawResult, data: dict, out_dir: Path) -> Path:
    """``linear_attention_compute.png``: loss above the floor against C = M x steps for every
    size with the frontier and its fit; the compute-optimal size against C."""
    sim = comparison.simulation
    fig, (ax, ax_m) = subplots(2, (12, 4.5))
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
    return save_figure(fig, Path(out_dir) / law.figure)


def plot_data(run: Any, law: LawResult, out_dir: Path) -> Path:
    """``linear_attention_data.png``: population loss against tau = lr x steps for every
    training-set size D (and fresh data); final loss above the floor against D."""
    fig, (ax, ax_d) = subplots(2, (12, 4.5))
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
    return save_figure(fig, Path(out_dir) / law.figure)


def _time_panel(ax: Any, curves: list, exps: list, title: str) -> None:
    """Loss above its floor against step for time-law runs (dots: simulation, lines: reduced
    dynamics, dotted: fit window), each labelled with its fit and prediction."""
    for i, (curve, e) in enumerate(zip(curves, exps, strict=True)):
        color = f"C{i % 10}"
        t = np.maximum(curve.steps, 0.5)
        name = f"beta = {curve.info['beta']:g}: " if "beta" in curve.info else ""
        ax.loglog(t, curve.sim.mean(axis=1) - curve.floor, "o", ms=3, color=color,
                  label=name + _label(e))
        ax.loglog(t, curve.reduced - curve.floor, "-", color=color, lw=1.2)
        for v in curve.window:
            ax.axvline(v, color=color, ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss above its floor")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)


def plot_context(run: Any, law: LawResult, out_dir: Path) -> Path:
    """``linear_attention_context.png``: L(N) - L(inf) at the last step against N + 2; the
    loss curves for every N; the time law of the control (N drawn independently of the task);
    the time laws with N tied to the task."""
    fig, (ax_n, ax_c, ax_t, ax_k) = subplots(4, (21, 4.5))
    ctx = np.asarray(run.contexts)
    finite = np.isfinite(ctx)
    x = ctx[finite] + 2.0
    e_n, e_t, *e_k = law.exponents
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
    ind = run.config["independent"]
    _time_panel(ax_t, [run.independent], [e_t],
                f"control: N ~ N^-{ind['power']:g} per sequence, independent of the task\n"
                f"(unchanged by construction: fixed N_eff = {run.independent.info['n_eff']:.1f})")
    cpl = run.config["coupled"]
    _time_panel(ax_k, run.coupled, e_k,
                f"N_k = {cpl['n0']:g} k^beta tied to the task, summed readout, "
                f"M = {cpl['model_size']}\n(dots: simulation, lines: reduced dynamics)")
    return save_figure(fig, Path(out_dir) / law.figure)


def plot_linear_attention(comparison: Any, out_dir: Path) -> list[Path]:
    """``comparison`` is a ``sweep.LinearAttentionComparison``. Write
    ``linear_attention_curves.png`` (loss vs step per model size, simulation mean with its 10-90%
    seed spread against the reduced dynamics, fit windows dotted; and the loss above
    the context floor with the predicted t^-(a/(1+a))) and ``linear_attention_sizes.png``
    (final loss above the context floor against model size)."""
    out_dir = Path(out_dir)
    sim, red = comparison.simulation, comparison.reduced_binned
    floor = comparison.summary["context_floor"]
    theory = comparison.summary["theory"]["time"]
    fig, (ax, ax_r) = subplots(2, (12, 4.5))
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
    paths = [save_figure(fig, out_dir / "linear_attention_curves.png")]

    fig, ax = subplots(1, (5.5, 4.5))
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
    paths.append(save_figure(fig, out_dir / "linear_attention_sizes.png"))
    return paths
