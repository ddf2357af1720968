"""The compact terminal summary of a run's fits (`peakprobe fit` prints it)."""

from __future__ import annotations

import math

from .run import RunFits


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, fmt)


def format_summary(run_fits: RunFits, n_sites: int = 5) -> str:
    """A few lines: the window, the loss exponent with its CI against 1/3, the verdict and
    the top sites."""
    rf = run_fits
    lines = [
        f"{rf.model or rf.run_dir.name}: {rf.n_points} checkpoints fitted on {rf.time_axis} "
        f"in [{rf.t_min:.6g}, {rf.t_max:.6g}]"
    ]
    loss = rf.loss
    if loss is None:
        lines.append("loss: no LM-head loss in the results")
    else:
        inside = "inside" if loss.third_in_ci else "outside"
        lines.append(
            f"loss: L = {_num(loss.L0)} + {_num(loss.c, '.4g')} t^-{_num(loss.alpha)}; "
            f"alpha {_num(loss.alpha)} [{_num(loss.alpha_lo)}, {_num(loss.alpha_hi)}] (90% CI), "
            f"1/3 {inside} ({_num(loss.third_distance_ci, '.2f')} half-widths away)"
        )
    b = rf.verdict["bottleneck"]
    lines.append(f"bottleneck: {b['verdict']} - {b['reason']}")
    lines.append(
        f"attention heads: {b['n_concentrating']} concentrating, {b['n_saturated']} saturated, "
        f"{b['n_diffuse']} diffuse; LM head late alpha {_num(b['lm_head_alpha'])}"
    )
    if b["top_sites"]:
        lines.append("top sites (late logit_std alpha, d loss / d log beta):")
        for s in b["top_sites"][:n_sites]:
            name = "lm_head" if s["site_kind"] == "lm_head" else f"attn L{s['layer']} H{s['head']}"
            lines.append(f"  {name:<16} alpha {_num(s['alpha'])}  "
                         f"sensitivity {_num(s['sensitivity'], '.4g')}")
    if rf.verdict["flags"]:
        lines.append("flags: " + ", ".join(rf.verdict["flags"]))
    return "\n".join(lines)
