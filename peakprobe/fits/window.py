"""Which checkpoints a fit uses: the time axis, the window rule, excluded duplicates, loss
spikes, and the scan of the loss exponent against the window start.

Window (the checkpoints fitted): t > 0 and step >= the start step, where the start step is the
manifest's ``fit_start_step`` when it has one (built-in families: the 1/3-law authors' windows,
step 512, or 256 for pythia-70m), else the manifest's ``schedule.warmup_steps``, else 1% of the
largest step. A user bound replaces that rule: ``t_min`` / ``t_max`` in units of the chosen
time axis, ``t_min_step`` / ``t_max_step`` in steps (all given bounds apply together).

Checkpoints that integrity.json flags (weights that duplicate another checkpoint's) are left
out of every fit before anything else and listed. A *spike* is a window checkpoint whose log
loss lies above (or below) both neighbours' and departs from their interpolation in log t by
more than SPIKE_NOISE_UNITS noise standard deviations (noise from second differences) and at
least SPIKE_MIN (0.5%), and by more than an adjacent candidate does; spikes are listed and
flagged, and still fitted (the Huber loss bounds their pull).

Loss scan: `curve.window_scan`, the scan external loss curves get too: the loss law refitted
with the window start moved later (each window keeps at least 10 checkpoints and 1.5 decades
of t), at most SCAN_BOOT bootstrap resamples per refit; a start drifts when its 90% interval
does not overlap the full window's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from peakprobe import results

from .common import FitError, noise_scale
from .curve import window_scan
from .loss import LossFit

#: the fewest checkpoints a window may hold (fewer: nothing at all can be fitted, an error);
#: each fit needs its own minimum (growth MIN_POINTS, the loss law loss.MIN_POINTS), and one
#: that lacks points is skipped and listed while the others run
MIN_WINDOW = 2
WARMUP_FRACTION = 0.01
SPIKE_NOISE_UNITS = 4.0
SPIKE_MIN = 0.005  # in log loss: a 0.5% jump
SCAN_BOOT = 200  # resamples per scanned fit at most (the scan is several loss fits)


@dataclass
class Window:
    """The chosen checkpoints: keep (T,) over the run's (non-excluded) checkpoints."""

    axis: str
    keep: np.ndarray
    start_rule: str


def read_duplicates(run_dir: str | os.PathLike) -> dict[str, dict]:
    """The checkpoints integrity.json flags (revision -> record); empty when absent."""
    return dict(results.read_integrity(run_dir))


def excluded_records(flagged: dict[str, dict], present: pd.DataFrame) -> list[dict]:
    """fits.json's `excluded` list: the flagged revisions that the results hold."""
    steps = dict(zip(present["revision"], present["step"], strict=True))
    return [
        {"revision": rev, "step": int(steps[rev]), "reason": "duplicate",
         "duplicates": list(rec.get("duplicates", [])), "whole": bool(rec.get("whole", True))}
        for rev, rec in sorted(flagged.items(), key=lambda kv: steps.get(kv[0], -1))
        if rev in steps
    ]


def time_axis(ck: pd.DataFrame, axis: str) -> str:
    if axis not in ("auto", "tau", "step"):
        raise FitError(f"time_axis must be 'auto', 'tau' or 'step', got {axis!r}")
    tau_known = bool(np.all(np.isfinite(ck["tau"].to_numpy(dtype=float))))
    if axis == "tau" and not tau_known:
        raise FitError(
            "time_axis='tau' needs a finite tau for every checkpoint (the schedule is unknown "
            "for some); use time_axis='step' or give the run a schedule"
        )
    if axis == "auto":
        return "tau" if tau_known else "step"
    return axis


def choose(ck: pd.DataFrame, axis: str, manifest: dict, *, t_min: float | None,
           t_max: float | None, t_min_step: float | None, t_max_step: float | None) -> Window:
    """The window over the checkpoints ``ck`` (columns step, tau), see the module docstring."""
    steps = ck["step"].to_numpy()
    t = ck[axis].to_numpy(dtype=float)
    keep = t > 0
    if t_min is None and t_min_step is None:
        start, rule = _default_start(steps, manifest)
        keep &= (steps >= start) & (steps > 0)
    else:
        rule = "user"
        if t_min is not None:
            keep &= t >= t_min
        if t_min_step is not None:
            keep &= steps >= t_min_step
    if t_max is not None:
        keep &= t <= t_max
    if t_max_step is not None:
        keep &= steps <= t_max_step
    if keep.sum() < MIN_WINDOW:
        raise FitError(
            f"only {int(keep.sum())} checkpoints fall in the fit window (nothing can be fitted to "
            f"fewer than {MIN_WINDOW}); sweep more checkpoints or {widen_hint(steps[t > 0])}"
        )
    return Window(axis=axis, keep=keep, start_rule=rule)


def widen_hint(steps: np.ndarray) -> str:
    """How to widen the window: the options, with the run's first step that has t > 0."""
    first = f" (e.g. --t-min-step {int(steps.min())}, the run's first)" if len(steps) else ""
    return f"widen the window with --t-min-step{first} / --t-max-step or --t-min / --t-max"


def skipped_fit(fit: str, n: int, needed: int, steps: np.ndarray, all_steps: np.ndarray) -> dict:
    """fits.json's record of a fit that could not run for lack of points in the window."""
    where = f"steps {int(steps[0])}-{int(steps[-1])}" if len(steps) else "no checkpoints"
    return {"fit": fit, "n_points": int(n), "needed": int(needed),
            "reason": f"{n} checkpoints in the window ({where}), the {fit} fit needs {needed}; "
                      f"{widen_hint(all_steps)}"}


def _default_start(steps: np.ndarray, manifest: dict) -> tuple[float, str]:
    fixed = manifest.get("fit_start_step")
    if fixed is not None:
        return float(fixed), f"manifest fit_start_step {int(fixed)}"
    warmup = (manifest.get("schedule") or {}).get("warmup_steps")
    if warmup is not None:
        return float(warmup), f"schedule warmup_steps {int(warmup)}"
    start = WARMUP_FRACTION * float(steps.max())
    return start, f"1% of the last step ({start:g})"


def spikes(loss: np.ndarray, steps: np.ndarray, t: np.ndarray,
           revisions: np.ndarray) -> list[dict]:
    """Window checkpoints whose loss jumps against both neighbours (module docstring).

    The jump is the log loss minus its interpolation (in log t) between the two neighbours; a
    candidate next to a larger candidate is that one's neighbour, not a spike itself."""
    ok = np.isfinite(loss) & (loss > 0) & (t > 0)
    v, st, rev, lt = np.log(loss[ok]), steps[ok], revisions[ok], np.log(t[ok])
    if len(v) < 3:
        return []
    tol = max(SPIKE_NOISE_UNITS * float(noise_scale(v[None, :])[0]), SPIKE_MIN)
    d_prev = v[1:-1] - v[:-2]
    d_next = v[1:-1] - v[2:]
    w = (lt[2:] - lt[1:-1]) / (lt[2:] - lt[:-2])  # weight of the previous neighbour
    jump = v[1:-1] - (w * v[:-2] + (1.0 - w) * v[2:])
    cand = (np.sign(d_prev) == np.sign(d_next)) & (np.abs(jump) > tol)
    size = np.where(cand, np.abs(jump), 0.0)
    left = np.concatenate([[0.0], size[:-1]])
    right = np.concatenate([size[1:], [0.0]])
    hit = cand & (size >= left) & (size >= right)
    return [{"revision": str(rev[i + 1]), "step": int(st[i + 1]),
             "loss": float(loss[ok][i + 1]), "jump": float(jump[i])}
            for i in np.flatnonzero(hit)]


def loss_scan(t: np.ndarray, loss: np.ndarray, steps: np.ndarray, full: LossFit, *,
              n_boot: int, seed: int, band: tuple[float, float]) -> dict:
    """fits.json's `loss_scan`: alpha(t_min) with intervals and verdicts, from the same window
    scan as external curves (`curve.window_scan`), and whether any start drifts."""
    table = window_scan("", t, loss, steps, (full.alpha_lo, full.alpha_hi),
                        n_boot=min(n_boot, SCAN_BOOT), seed=seed, band=band)
    rows = [{"t_min": float(r.t_min), "step_min": int(r.t_min_step), "n_points": int(r.n_points),
             "alpha": float(r.alpha), "alpha_lo": float(r.alpha_lo), "alpha_hi": float(r.alpha_hi),
             "verdict": str(r.verdict), "drift": bool(r.drift)} for r in table.itertuples()]
    return {"drift": any(r["drift"] for r in rows), "rows": rows}

