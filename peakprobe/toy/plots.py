"""Figures for the toy models (matplotlib's Agg canvas); drawing only, no computation.

``subplots`` and ``save_figure`` are the figure helpers every toy draws with (no pyplot, no
global backend switch); ``plot_peaked`` draws one peaked-softmax run (loss, ||W||_F and logit
std against step, log-log, with the fitted power laws over the fit window). The linear-attention
figures are ``peakprobe.toy.linear_attention.plots``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from .. import vocab
from ..probes.gaussian_entropy import peaked_threshold

__all__ = ["plot_peaked", "save_figure", "subplots"]


def subplots(ncols: int, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A figure on its own Agg canvas (no pyplot, no global backend switch)."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, ncols)
    return fig, axes


def save_figure(fig: Figure, path: Path) -> Path:
    """Lay out ``fig`` and write it to ``path`` (folders made as needed); return ``path``."""
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
    fig, (ax_l, ax_g) = subplots(2, (10, 4))

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
    return [save_figure(fig, out_dir / f"peaked_{run.optimizer}.png")]
