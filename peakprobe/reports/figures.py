"""The report's figures, drawn with matplotlib's Agg canvas and returned as PNG and SVG bytes.

Owns: the alpha and final-peakedness heatmaps (layer x head, both peakedness criteria), the
log-log growth panels of the selected heads and the LM head, the loss curve, the gain curves
G(t) per softmax with their fits, the alpha(t_min) window scan against the band, and the
sensitivity ranking bar chart. Figures
are built on ``matplotlib.figure.Figure`` (no pyplot, no global backend switch) and saved with
fixed metadata and a fixed SVG hash salt, so the same inputs give the same bytes. No user text
(model or revision names) is drawn, so nothing needs escaping and mathtext never parses it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator

from peakprobe import vocab
from peakprobe.formatting import num
from peakprobe.reports.tables import Curve, site_matrix
from peakprobe.vocab import ATTN, ATTN_ALL, ATTN_LAYER, LM_HEAD, PEAKED_ENTROPY, THIRD, site_label

DPI = 110
SVG_HASHSALT = "peakprobe"
RC = {"svg.hashsalt": SVG_HASHSALT, "svg.fonttype": "path", "font.size": 9, "axes.titlesize": 9}
MAX_RANKED = 20  # bars in the sensitivity figure


@dataclass
class RenderedFigure:
    """One figure, ready to write (``figures/<name>.png|svg``) and to embed."""

    name: str
    title: str
    caption: str
    png: bytes
    svg: bytes


def _new_figure(width: float, height: float, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure) -> tuple[bytes, bytes]:
    """PNG and SVG bytes of ``fig`` with no date, software or creator stamp."""
    png, svg = io.BytesIO(), io.BytesIO()
    with matplotlib.rc_context(RC):
        fig.savefig(png, format="png", dpi=DPI, metadata={"Software": None})
        fig.savefig(svg, format="svg", metadata={"Date": None, "Creator": None})
    return png.getvalue(), svg.getvalue()


def render(fig: Figure, name: str, title: str, caption: str) -> RenderedFigure:
    """``fig`` saved (PNG and SVG) as the figure ``name``."""
    png, svg = _save(fig)
    return RenderedFigure(name, title, caption, png, svg)


def _labels(ax, xlabel: str, ylabel: str, legend_size: int = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size, frameon=False)


def _heatmap(
    mat: np.ndarray, cmap: str, vmin: float, vmax: float, cbar_label: str, marks: tuple[float, ...]
) -> Figure:
    """Layer (rows, layer 0 on top) x head (columns) colour map of ``mat`` (L, H); NaN cells grey."""
    n_layers, n_heads = mat.shape
    fig = _new_figure(
        min(12.0, max(4.2, 2.6 + 0.2 * n_heads)), min(11.0, max(3.0, 1.6 + 0.17 * n_layers))
    )
    ax = fig.add_subplot()
    colors = matplotlib.colormaps[cmap].with_extremes(bad="#d9d9d9")
    mesh = ax.pcolormesh(
        np.arange(n_heads + 1) - 0.5,
        np.arange(n_layers + 1) - 0.5,
        np.ma.masked_invalid(mat),
        cmap=colors,
        vmin=vmin,
        vmax=vmax,
        edgecolors="white",
        linewidth=0.3 if n_heads * n_layers <= 400 else 0.0,
        rasterized=n_heads * n_layers > 400,  # a big grid: one image in the SVG, not a path per cell
    )
    ax.set_xlim(-0.5, n_heads - 0.5)
    ax.set_ylim(n_layers - 0.5, -0.5)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_heads, 20)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_layers, 18)))
    bar = fig.colorbar(mesh, ax=ax, shrink=0.9)
    bar.set_label(cbar_label)
    for value in marks:  # reference levels drawn across the colour bar
        if vmin < value < vmax:
            bar.ax.axhline(value, color="white", linewidth=2.0)
            bar.ax.axhline(value, color="black", linewidth=1.0)
    return fig


def alpha_heatmap(heads: pd.DataFrame) -> RenderedFigure | None:
    mat = site_matrix(heads, "alpha")  # (L, H)
    if mat.size == 0 or not np.isfinite(mat).any():
        return None
    finite = mat[np.isfinite(mat)]
    vmin = min(0.0, float(np.percentile(finite, 2)))
    vmax = max(0.5, float(np.percentile(finite, 98)))
    fig = _heatmap(mat, "viridis", vmin, vmax, "growth exponent α (line: 1/3)", (THIRD,))
    lm = heads[heads["site_kind"] == LM_HEAD]
    lm_text = f" The LM head's α is {num(lm['alpha'].iloc[0])}." if not lm.empty else ""
    return render(
        fig,
        "alpha_heatmap",
        "Growth exponent α of logit_std, per head",
        "Exponent α of logit_std ∝ t^α fitted per attention head (fits.parquet); "
        f"grey: no fit. Colour range clipped to [{vmin:.2f}, {vmax:.2f}]." + lm_text,
    )


def peaked_heatmap(
    heads: pd.DataFrame, last_revision: str, criterion: str = vocab.LOGIT_STD
) -> RenderedFigure | None:
    """Final peaked fraction per head under one criterion: ``logit_std`` (the probes' flag) or
    ``entropy`` (the entropy-equivalent beta_eff)."""
    column = "final_peaked" if criterion == vocab.LOGIT_STD else f"final_{PEAKED_ENTROPY}"
    mat = site_matrix(heads, column)  # (L, H)
    if mat.size == 0 or not np.isfinite(mat).any():
        return None
    fig = _heatmap(mat, "magma", 0.0, 1.0, "final peaked fraction", ())
    if criterion == vocab.LOGIT_STD:
        name, title = "peaked_heatmap", "Final peakedness per head (logit std)"
        rule = "whose logit_std exceeds sqrt(2 ln n)"
    else:
        name, title = "peaked_entropy_heatmap", "Final peakedness per head (entropy-equivalent)"
        rule = "whose entropy-equivalent inverse temperature β_eff exceeds sqrt(2 ln n)"
    return render(
        fig,
        name,
        title,
        f"Fraction of query rows {rule} (n = keys the row attends to) at the last checkpoint "
        f"({last_revision}); 1 = every row in the peaked, low-temperature regime.",
    )


def _sparse_log_ticks(ax) -> None:
    """Minor log ticks at 2 and 5 only: the default eight per decade cost most of the drawing time."""
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_locator(LogLocator(base=10.0, subs=(2.0, 5.0)))


def _panel(ax, curve: Curve, time_axis: str, ylabel: str) -> None:
    ax.loglog(curve.t, curve.value, "o", markersize=3, color="#1f77b4", label="measured")
    if curve.fit_t.size:
        ax.loglog(
            curve.fit_t,
            curve.fit_value,
            "-",
            color="#d62728",
            linewidth=1.5,
            label=f"fit α={num(curve.alpha)}",
        )
        ax.loglog(curve.fit_t, curve.ref_value, "--", color="black", linewidth=1.0, label="α=1/3")
        ax.axvspan(curve.fit_t[0], curve.fit_t[-1], color="#eeeeee", zorder=0)
    ci = f" [{num(curve.alpha_lo)}, {num(curve.alpha_hi)}]" if np.isfinite(curve.alpha_lo) else ""
    _sparse_log_ticks(ax)
    ax.set_title(f"{curve.label}  α={num(curve.alpha)}{ci}")
    ax.set_xlabel(time_axis)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="best", frameon=False)


def growth_panels(curves: list[Curve], time_axis: str, how: str) -> RenderedFigure | None:
    curves = [c for c in curves if c.t.size]
    if not curves:
        return None
    n_cols = min(4, len(curves))
    n_rows = math.ceil(len(curves) / n_cols)
    width, height = 3.0 * n_cols, 2.6 * n_rows
    fig = _new_figure(
        width, height, layout=None
    )  # fixed margins: constrained layout doubles the time
    fig.subplots_adjust(
        left=0.55 / width,
        right=1 - 0.1 / width,
        bottom=0.45 / height,
        top=1 - 0.3 / height,
        wspace=0.45,
        hspace=0.55,
    )
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(curves):
            _panel(ax, curves[i], time_axis, vocab.LOGIT_STD)
        else:
            ax.set_axis_off()
    return render(
        fig,
        "growth_curves",
        "logit_std against training time (log-log)",
        f"Shown: {how}, and the LM head. Dots: measured logit_std; red: the fitted "
        "c·t^α over its window (shaded); dashed: a t^(1/3) line through the fit's "
        "geometric middle.",
    )


def loss_figure(curve: Curve | None, time_axis: str) -> RenderedFigure | None:
    if curve is None:
        return None
    fig = _new_figure(5.5, 3.6)
    ax = fig.add_subplot()
    ax.loglog(curve.t, curve.value, "o", markersize=3, color="#1f77b4", label="measured loss")
    if curve.fit_t.size:
        ax.loglog(
            curve.fit_t,
            curve.fit_value,
            "-",
            color="#d62728",
            linewidth=1.5,
            label=f"fit L0 + c·t^-α, α={num(curve.alpha)}",
        )
        ax.loglog(
            curve.fit_t,
            curve.ref_value,
            "--",
            color="black",
            linewidth=1.0,
            label="L0 + c'·t^(-1/3)",
        )
        ax.axvspan(curve.fit_t[0], curve.fit_t[-1], color="#eeeeee", zorder=0)
        if np.isfinite(curve.L0) and curve.L0 > 0:
            ax.axhline(
                curve.L0, color="grey", linestyle=":", linewidth=1.0, label=f"L0={num(curve.L0)}"
            )
    _sparse_log_ticks(ax)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # a loss spans about one decade:
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))  # label the 2 and 5 ticks too
    _labels(ax, time_axis, "loss (nats)")
    return render(
        fig,
        "loss_curve",
        "Loss against training time (log-log)",
        "Dots: the LM head's mean next-token loss per checkpoint; red: the fitted "
        "L0 + c·t^-α over its window (shaded); dashed: the same L0 with exponent 1/3, "
        "equal to the fit at the window's geometric middle.",
    )


def sensitivity_figure(ranking: pd.DataFrame) -> RenderedFigure | None:
    if ranking.empty:
        return None
    top = ranking.head(MAX_RANKED)
    fig = _new_figure(5.5, 1.0 + 0.22 * len(top))
    ax = fig.add_subplot()
    labels = [
        site_label(k, layer, head)
        for k, layer, head in zip(top["site_kind"], top["layer"], top["head"], strict=True)
    ]
    y = np.arange(len(top))
    colors = ["#d62728" if v < 0 else "#1f77b4" for v in top["sensitivity"]]
    ax.barh(y, top["sensitivity"].to_numpy(), color=colors)
    ax.set_yticks(y, labels)
    ax.set_ylim(len(top) - 0.5, -0.5)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("d loss / d log β at the last checkpoint")
    return render(
        fig,
        "sensitivity",
        "Sensitivity ranking",
        f"The first {len(top)} sites by d loss / d log β at the last checkpoint, most negative first; "
        "red: scaling that softmax's logits up would lower the loss.",
    )


GAIN_GROUPS = (  # (panel title, site kinds drawn in it)
    ("LM head and all attention", (LM_HEAD, ATTN_ALL)),
    ("attention, per layer", (ATTN_LAYER,)),
    ("top heads by final G", (ATTN,)),
)


def gain_figure(curves: list[Curve], time_axis: str) -> RenderedFigure | None:
    """G(t) per softmax, log-log, in up to three panels (LM head + all attention, layers, heads);
    fitted c t^-alpha in solid over its window, a t^(-1/3) line dashed."""
    curves = [c for c in curves if c.t.size and np.any(c.value > 0)]
    panels = [(title, [c for c in curves if c.site_kind in kinds]) for title, kinds in GAIN_GROUPS]
    panels = [(title, cs) for title, cs in panels if cs]
    if not panels:
        return None
    width, height = 3.6 * len(panels), 3.1
    fig = _new_figure(width, height, layout=None)
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.1 / width, bottom=0.5 / height, top=1 - 0.3 / height, wspace=0.35)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    cmap = matplotlib.colormaps["viridis"]
    for ax, (title, cs) in zip(axes, panels, strict=True):
        many = len(cs) > 6
        for i, c in enumerate(cs):
            color = cmap(i / max(1, len(cs) - 1)) if many else f"C{i}"
            keep = c.value > 0
            label = None if many else c.label
            ax.loglog(c.t[keep], c.value[keep], "o-" if not many else "-", markersize=2.5, linewidth=0.8, color=color, label=label)
            if c.fit_t.size and not many:
                ax.loglog(c.fit_t, c.fit_value, "-", color=color, linewidth=2.0, alpha=0.6)
                ax.loglog(c.fit_t, c.ref_value, "--", color="black", linewidth=0.8)
        _sparse_log_ticks(ax)
        ax.set_title(title + (f" ({len(cs)} layers, colour = depth)" if many else ""))
        ax.set_xlabel(time_axis)
        ax.set_ylabel("gain G (nats)")
        if not many:
            ax.legend(fontsize=7, frameon=False)
    return render(
        fig,
        "gain_curves",
        "Loss contribution G against training time (log-log)",
        "G = L(β = 1) − min over β of L(β), β scaling one softmax's logits (or one shared by a "
        "group); thin lines with dots: measured; thick: the fitted c·t^-α over its window; "
        "dashed black: a t^(-1/3) line through the fit's geometric middle.",
    )


def logit_max_figure(series: pd.DataFrame, time_axis: str) -> RenderedFigure | None:
    """The largest logit of each layer (max over heads) and of the LM head along training, with
    the max-logit alarm's threshold (``vocab.LOGIT_MAX_ALARM``) where the curves reach it."""
    if series.empty:
        return None
    series = series[(series["t"].astype(float) > 0) & np.isfinite(series["value"].astype(float))]
    if series.empty:
        return None
    fig = _new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    layers = sorted(int(x) for x in series["layer"].unique())
    cmap = matplotlib.colormaps["viridis"]
    named = len(layers) <= 9  # beyond that, colour alone says the depth (the caption says how)
    for i, layer in enumerate(layers):
        s = series[series["layer"] == layer]
        lm = layer < 0
        label = "LM head" if lm else (f"layer {layer}" if named else None)
        ax.plot(s["t"], s["value"], color="black" if lm else cmap(i / max(1, len(layers) - 1)),
                linestyle="--" if lm else "-", marker="o", markersize=2.5, label=label)
    ax.set_xscale("log")
    top = float(series["value"].max())
    if top > 0.5 * vocab.LOGIT_MAX_ALARM:
        ax.axhline(vocab.LOGIT_MAX_ALARM, color="red", linewidth=1.0, linestyle=":",
                   label=f"{vocab.LOGIT_MAX_ALARM:g} (QK-clip threshold)")
    _labels(ax, time_axis, "largest logit")
    return render(
        fig,
        "logit_max_curves",
        "Largest logit per layer",
        "The largest pre-softmax logit over every evaluated row, key and head of each layer "
        "(logit_max, the quantity QK-clip / MuonClip bound; colour from the first layer, dark, "
        "to the last, yellow), and the LM head's over the vocabulary (dashed), at every "
        "checkpoint.",
    )


def window_scan_figure(rows: list[dict], band: tuple[float, float], time_axis: str) -> RenderedFigure | None:
    """alpha with its interval against the window start t_min, the band shaded, 1/3 dashed."""
    rows = [r for r in rows if np.isfinite(r["t_min"]) and r["t_min"] > 0 and np.isfinite(r["alpha"])]
    if not rows:
        return None
    fig = _new_figure(5.5, 3.4)
    ax = fig.add_subplot()
    ax.axhspan(band[0], band[1], color="#dff0d8", zorder=0, label=f"band [{band[0]:g}, {band[1]:g}]")
    ax.axhline(THIRD, color="black", linestyle="--", linewidth=1.0, label="1/3")
    for quantity in dict.fromkeys(r["quantity"] for r in rows):
        rs = [r for r in rows if r["quantity"] == quantity]
        t = np.array([r["t_min"] for r in rs])
        a = np.array([r["alpha"] for r in rs])
        lo = np.array([r["alpha_lo"] for r in rs])
        hi = np.array([r["alpha_hi"] for r in rs])
        err = np.vstack([np.where(np.isfinite(lo), a - lo, 0.0), np.where(np.isfinite(hi), hi - a, 0.0)])
        ax.errorbar(t, a, yerr=err, fmt="o-", markersize=3, capsize=2, linewidth=1.0, label=quantity)
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(LogLocator(base=10.0, subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))  # a scan spans about one decade
    _labels(ax, f"window start t_min ({time_axis})", "exponent α")
    return render(
        fig,
        "window_scan",
        "Exponent against the start of the fit window",
        "Each point: the exponent fitted on the window starting at t_min (to the run's last "
        "checkpoint), with its interval; green: the equivalence band around 1/3; dashed: 1/3. "
        "A law that holds gives a flat run of points inside the band.",
    )

def router_figure(series: pd.DataFrame, table: pd.DataFrame, time_axis: str) -> RenderedFigure | None:
    """Each MoE router's logit std along training on log-log axes, with its fitted power law
    (``table``: ``reports.routers.router_table``); None for a dense model."""
    series = series[(series["t"].astype(float) > 0) & np.isfinite(series["value"].astype(float))
                    & (series["value"].astype(float) > 0)]
    if series.empty:
        return None
    fig = _new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    layers = sorted(int(x) for x in series["layer"].unique())
    cmap = matplotlib.colormaps["viridis"]
    fitted = table.set_index("layer") if not table.empty else table
    for i, layer in enumerate(layers):
        s = series[series["layer"] == layer]
        colour = cmap(i / max(1, len(layers) - 1))
        alpha = fitted["alpha"].get(layer, np.nan) if len(fitted) else np.nan
        name = site_label(vocab.ROUTER, layer) + (f" (α {alpha:.2f})" if np.isfinite(alpha) else "")
        ax.plot(s["t"], s["value"], color=colour, marker="o", markersize=2.5,
                label=name if len(layers) <= 9 else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _labels(ax, time_axis, "router logit std")
    return render(
        fig,
        "router_curves",
        "MoE routers: logit growth",
        "The logit std over experts, averaged over tokens, of each router (colour from the first "
        "layer, dark, to the last, yellow) at every checkpoint, with its fitted growth exponent α.",
    )
