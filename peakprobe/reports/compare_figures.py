"""The comparison report's figures: every member (a fitted run or an external curve) on shared axes.

Owns: the overlaid loss curves, the reducible loss L - L0 with the fitted power laws, the loss
exponent against model size, the growth exponent against relative depth, and the window scan
(alpha against the window start). Drawn with the Agg canvas of ``reports.figures`` (same
deterministic PNG / SVG bytes). Member names appear in legends: a ``$`` is escaped so
mathtext never parses user text.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FormatStrFormatter

from peakprobe.reports.figures import RenderedFigure, _new_figure, _sparse_log_ticks, render
from peakprobe.vocab import THIRD

MAX_TAB10 = 10
Y_MAX_SCAN = 1.2  # late windows can leave alpha unidentified: keep the band readable


def _colors(n: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= MAX_TAB10 else "viridis"]
    return [cmap(i if n <= MAX_TAB10 else i / max(1, n - 1)) for i in range(n)]


def _label(name: str) -> str:
    return name.replace("$", r"\$")


def _labels(ax, xlabel: str, ylabel: str, n: int) -> None:
    """Axis labels, and a legend of ``n`` entries (two columns past 8)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7 if n <= 8 else 6, frameon=False, ncol=1 if n <= 8 else 2)


def _axes(width: float, height: float):
    """A figure with one axes and fixed margins (constrained layout would double the time)."""
    fig = _new_figure(width, height, layout=None)
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - 0.15 / height)
    return fig, fig.add_subplot()


def loss_overlay(members: list, x_label: str) -> RenderedFigure | None:
    """Loss against the shared time axis; filled dots inside each fit window, hollow outside."""
    if not members:
        return None
    fig, ax = _axes(6.4, 4.0)
    for m, col in zip(members, _colors(len(members)), strict=True):
        x, y, w = m.x, m.loss, m.in_window
        ax.loglog(x[w], y[w], "o-", color=col, markersize=3, linewidth=1.0, label=_label(m.name))
        if (~w).any():
            ax.loglog(x[~w], y[~w], "o", color=col, markersize=3, markerfacecolor="none")
        if np.isfinite(m.alpha) and w.any():
            xs = np.geomspace(x[w][0], x[w][-1], 60)
            ax.loglog(xs, m.L0 + m.c * (xs / m.x_scale) ** -m.alpha, "--", color=col, linewidth=0.8)
    _sparse_log_ticks(ax)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    _labels(ax, x_label, "loss (nats)", len(members))
    return render(
        fig, "loss_overlay", f"Loss against {x_label}, every member",
        "Dots joined by lines: checkpoints inside each member's fit window; hollow dots: outside "
        "it; dashed: the fitted L0 + c·t^-α.")


def reducible(members: list, x_label: str) -> RenderedFigure | None:
    """L - L0 on log-log axes with each member's fitted c t^-alpha."""
    members = [m for m in members if np.isfinite(m.alpha)]
    if not members:
        return None
    fig, ax = _axes(6.4, 4.0)
    for m, col in zip(members, _colors(len(members)), strict=True):
        w = m.in_window
        gap = m.loss - m.L0
        ok = w & (gap > 0)
        ax.loglog(m.x[ok], gap[ok], "o", color=col, markersize=3,
                  label=f"{_label(m.name)}: α={m.alpha:.3f}")
        if ok.any():
            xs = np.geomspace(m.x[ok][0], m.x[ok][-1], 60)
            ax.loglog(xs, m.c * (xs / m.x_scale) ** -m.alpha, "-", color=col, linewidth=1.0)
    _sparse_log_ticks(ax)
    _labels(ax, x_label, "L − L0 (nats)", len(members))
    return render(
        fig, "reducible", "Reducible loss L − L0, every member",
        "Dots: loss minus each member's fitted L0, inside its fit window (points at or below L0 "
        "are not drawn); lines: the fitted c·t^-α. Parallel lines mean equal exponents.")


def _band(ax, band: tuple[float, float], vertical: bool = False) -> None:
    span = ax.axvspan if vertical else ax.axhspan
    line = ax.axvline if vertical else ax.axhline
    span(band[0], band[1], color="#e8f3e8", zorder=0, label=f"band [{band[0]:g}, {band[1]:g}]")
    line(THIRD, color="black", linestyle="--", linewidth=0.8, label="1/3")


def exponent_vs_size(members: list, band: tuple[float, float]) -> RenderedFigure | None:
    """Loss exponent with its 90% interval against the parameter count (log axis)."""
    sized = [m for m in members if m.n_params and np.isfinite(m.alpha)]
    if not sized:
        return None
    fig, ax = _axes(5.6, 3.6)
    _band(ax, band)
    for m, col in zip(sized, _colors(len(sized)), strict=True):
        lo = m.alpha - m.alpha_lo if np.isfinite(m.alpha_lo) else 0.0
        hi = m.alpha_hi - m.alpha if np.isfinite(m.alpha_hi) else 0.0
        ax.errorbar([m.n_params], [m.alpha], yerr=[[max(lo, 0.0)], [max(hi, 0.0)]], fmt="o",
                    color=col, capsize=3, markersize=4, label=_label(m.name))
    ax.set_xscale("log")
    _labels(ax, "parameters", "loss exponent α (90% CI)", len(sized) + 2)
    missing = len(members) - len(sized)
    note = f" {missing} member(s) without a parameter count or a loss fit are not drawn." if missing else ""
    return render(
        fig, "exponent_vs_size", "Loss exponent against model size",
        "Each member's fitted loss exponent with its 90% bootstrap interval; green: the "
        "equivalence band around 1/3 (dashed)." + note)


def growth_vs_depth(growth: pd.DataFrame, names: list[str], band: tuple[float, float]
                    ) -> RenderedFigure | None:
    """Per layer: the median over heads of the attention logit_std growth exponent, bars from
    the 25th to the 75th percentile over heads, against relative depth (layer + 1) / n_layers."""
    if growth.empty or not np.isfinite(growth["alpha"]).any():
        return None
    fig, ax = _axes(6.4, 3.8)
    _band(ax, band)
    present = [n for n in names if n in set(growth["member"])]
    for name, col in zip(present, _colors(len(present)), strict=True):
        g = growth[(growth["member"] == name) & np.isfinite(growth["alpha"])]
        per = g.groupby("rel_depth")["alpha"]
        med, q1, q3 = per.median(), per.quantile(0.25), per.quantile(0.75)
        ax.errorbar(med.index, med.to_numpy(), yerr=[med - q1, q3 - med], fmt="o-", color=col,
                    capsize=2, markersize=3, linewidth=1.0, label=_label(name))
    ax.set_xlim(0, 1.05)
    _labels(ax, "relative depth (layer + 1) / n_layers", "logit_std growth exponent", len(present) + 2)
    return render(
        fig, "growth_vs_depth", "Attention logit growth exponent against relative depth",
        "Per layer, the median over its heads of the fitted logit_std ∝ t^α exponent; bars: 25th "
        "to 75th percentile over heads. Each head's exponent, interval and verdict is in "
        "growth.csv.")


def window_scan(scan: pd.DataFrame, names: list[str], band: tuple[float, float]
                ) -> RenderedFigure | None:
    """Loss exponent against the first step of the fit window, with 90% intervals."""
    if scan.empty:
        return None
    fig, ax = _axes(6.4, 3.8)
    _band(ax, band)
    present = [n for n in names if n in set(scan["member"])]
    for k, (name, col) in enumerate(zip(present, _colors(len(present)), strict=True)):
        s = scan[scan["member"] == name]
        shift = 1.0 + 0.03 * (k - (len(present) - 1) / 2)  # spread the bars apart a little
        lo = np.clip(s["alpha"] - s["alpha_lo"], 0, None)
        hi = np.clip(s["alpha_hi"] - s["alpha"], 0, None)
        ax.errorbar(s["t_min_step"] * shift, s["alpha"], yerr=[lo.fillna(0), hi.fillna(0)],
                    fmt="o-", color=col, capsize=2, markersize=3, linewidth=0.8, label=_label(name))
        drift = s["drift"].to_numpy(dtype=bool)
        if drift.any():
            ax.plot(s["t_min_step"][drift] * shift, s["alpha"][drift], "x", color="#d62728",
                    markersize=7)
    ax.set_xscale("log")
    ax.set_ylim(min(-0.05, ax.get_ylim()[0]), min(ax.get_ylim()[1], Y_MAX_SCAN))
    _labels(ax, "first step of the fit window", "loss exponent α (90% CI)", len(present) + 2)
    return render(
        fig, "window_scan", "Window scan: the loss exponent against the window start",
        "The loss law refitted with later and later first checkpoints (the last one fixed); red "
        "crosses: an interval that does not overlap the full window's 90% interval (flag "
        f"window_drift). The axis stops at α = {Y_MAX_SCAN:g}; scan.csv has every value.")
