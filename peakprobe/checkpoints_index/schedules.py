"""Learning-rate schedules and the dynamic time tau they define.

tau(t) = integral_0^t lr(s) / lr_max ds, the continuous dynamic time of the 1/3 law. Three schedules:

- :class:`WarmupCosine`: linear warmup from 0 to ``lr_max`` over ``warmup_steps``, cosine decay to
  ``final_lr_ratio * lr_max`` at ``total_steps``, constant after; tau in closed form.
- :class:`WarmupLinear`: the same with a linear instead of a cosine decay.
- :class:`TableSchedule`: learning rates at given steps, linearly interpolated, constant beyond
  the first and last entries; tau by exact integration of that interpolant (trapezoids).

On disk (docs/checkpoints.md) a local run may carry ``schedule.json`` (any of the JSON forms in
:data:`ACCEPTED_FORMS`), ``schedule.csv`` (step and learning-rate columns, e.g. a W&B export), or
an HF Trainer ``trainer_state.json`` whose ``log_history`` learning rates are read as a table.
Both ``lr`` and ``tau`` accept a scalar (returning a float) or an array (returning an array).
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointIndexWarning, RevisionNameError, ScheduleError, one_line
from .names import parse_trainer_folder

SCHEDULE_FILE = "schedule.json"
SCHEDULE_CSV = "schedule.csv"
TRAINER_STATE_FILE = "trainer_state.json"
ACCEPTED_FORMS = (
    'accepted schedule forms: JSON {"kind": "warmup_cosine"|"warmup_linear", "lr_max", '
    '"warmup_steps", "total_steps"[, "final_lr_ratio"]}; JSON {"steps": [...], "lr": [...]}; '
    'JSON {"lr": [lr at step 0, 1, ...]} or a bare JSON list of per-step lr; a CSV with a step '
    "column (step, _step, global_step, train/global_step) and a learning-rate column (lr, "
    "learning_rate, train/learning_rate, ...), e.g. a W&B export; or an HF trainer_state.json"
)
_CSV_STEP_COLUMNS = ("step", "_step", "global_step", "train/global_step", "trainer/global_step")


def _steps_array(step: Any) -> tuple[np.ndarray, bool]:
    """``step`` as a float64 array, and whether the caller passed a scalar."""
    arr = np.asarray(step, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ScheduleError(f"schedule steps must be finite and >= 0, got {step!r}")
    return arr, arr.ndim == 0


def _out(arr: np.ndarray, scalar: bool) -> float | np.ndarray:
    return float(arr) if scalar else arr


@dataclass(frozen=True)
class _WarmupDecay(ABC):
    """Linear warmup from 0 to ``lr_max`` over ``warmup_steps``, then a decay (the subclass's) to
    ``final_lr_ratio * lr_max`` at ``total_steps``, constant after; tau in closed form."""

    lr_max: float
    warmup_steps: float
    total_steps: float
    final_lr_ratio: float = 0.1
    KIND = ""  # the schedule.json "kind"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr_max) and self.lr_max > 0):
            raise ScheduleError(f"{self.KIND} lr_max must be > 0, got {self.lr_max}")
        if not (0 <= self.warmup_steps <= self.total_steps and self.total_steps > 0):
            raise ScheduleError(
                f"{self.KIND} needs 0 <= warmup_steps <= total_steps and total_steps > 0, "
                f"got warmup_steps={self.warmup_steps}, total_steps={self.total_steps}"
            )
        if not 0 <= self.final_lr_ratio <= 1:
            raise ScheduleError(
                f"{self.KIND} final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}"
            )

    @abstractmethod
    def _decay_ratio(self, s: np.ndarray, w: float, total: float, r: float) -> np.ndarray:
        """lr / lr_max from the end of the warmup on (s: steps)."""

    @abstractmethod
    def _decay_integral(self, u: np.ndarray, decay: float, r: float) -> np.ndarray:
        """The integral of the decay's ratio over [0, u] (u: steps past the warmup)."""

    def lr(self, step: Any) -> float | np.ndarray:
        s, scalar = _steps_array(step)
        w, total, r = float(self.warmup_steps), float(self.total_steps), self.final_lr_ratio
        ratio = self._decay_ratio(s, w, total, r)
        if w > 0:
            ratio = np.where(s < w, s / w, ratio)
        return _out(self.lr_max * ratio, scalar)

    def tau(self, step: Any) -> float | np.ndarray:
        s, scalar = _steps_array(step)
        w, total, r = float(self.warmup_steps), float(self.total_steps), self.final_lr_ratio
        decay = total - w
        sw = np.minimum(s, w)
        warm = sw * sw / (2.0 * w) if w > 0 else np.zeros_like(s)  # integral of s/w
        u = np.clip(s - w, 0.0, decay)
        mid = self._decay_integral(u, decay, r) if decay > 0 else np.zeros_like(s)
        tail = r * np.maximum(s - total, 0.0)
        return _out(warm + mid + tail, scalar)

    def to_json(self) -> dict:
        return {"kind": self.KIND, **asdict(self)}

    def describe(self) -> str:
        return (
            f"{self.KIND}(lr_max={self.lr_max:g}, warmup={self.warmup_steps:g}, "
            f"total={self.total_steps:g}, final={self.final_lr_ratio:g}x)"
        )


@dataclass(frozen=True)
class WarmupCosine(_WarmupDecay):
    """Linear warmup from 0, cosine decay to ``final_lr_ratio * lr_max`` at ``total_steps``."""

    KIND = "warmup_cosine"

    def _decay_ratio(self, s, w, total, r):
        decay = total - w
        ratio = np.full_like(s, r)  # after total_steps: constant at the floor
        if decay > 0:
            u = np.clip(s - w, 0.0, decay)
            cosine = r + (1.0 - r) * 0.5 * (1.0 + np.cos(np.pi * u / decay))
            ratio = np.where(s <= total, cosine, ratio)
        return ratio

    def _decay_integral(self, u, decay, r):  # integral of r + (1-r)(1+cos(pi u/D))/2
        return r * u + (1.0 - r) * 0.5 * (u + decay / np.pi * np.sin(np.pi * u / decay))


@dataclass(frozen=True)
class WarmupLinear(_WarmupDecay):
    """Linear warmup from 0, linear decay to ``final_lr_ratio * lr_max`` at ``total_steps``."""

    KIND = "warmup_linear"

    def _decay_ratio(self, s, w, total, r):
        return np.interp(s, [w, total], [1.0, r])  # constant r after total_steps

    def _decay_integral(self, u, decay, r):  # integral of 1 - (1-r) u/D
        return u - (1.0 - r) * u * u / (2.0 * decay)


class TableSchedule:
    """Learning rates at steps; linear in between, constant outside. ``lr_max`` defaults to max(lr).

    A plain class rather than a dataclass because ``lr`` is both the constructor argument (the
    table, kept as ``lr_values``) and the method giving the learning rate at a step.
    """

    __slots__ = ("steps", "lr_values", "lr_max")

    def __init__(self, steps: Any, lr: Any, lr_max: float | None = None) -> None:
        try:
            steps_t = tuple(float(x) for x in steps)
            lr_t = tuple(float(x) for x in lr)
        except (TypeError, ValueError):
            raise ScheduleError("table schedule steps and lr must be lists of numbers") from None
        if not steps_t or len(steps_t) != len(lr_t):
            raise ScheduleError(
                f"table schedule needs equally long, non-empty steps and lr (got {len(steps_t)} and {len(lr_t)})"
            )
        if not all(math.isfinite(x) and x >= 0 for x in steps_t + lr_t):
            raise ScheduleError("table schedule steps and lr must be finite and >= 0")
        if any(b <= a for a, b in pairwise(steps_t)):
            raise ScheduleError("table schedule steps must be strictly increasing")
        top = max(lr_t) if lr_max is None else float(lr_max)
        if not (math.isfinite(top) and top > 0):
            raise ScheduleError(f"table schedule lr_max must be > 0, got {top}")
        self.steps: tuple[float, ...] = steps_t
        self.lr_values: tuple[float, ...] = lr_t
        self.lr_max: float = top

    def __repr__(self) -> str:
        return f"TableSchedule(steps={list(self.steps)!r}, lr={list(self.lr_values)!r}, lr_max={self.lr_max!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TableSchedule):
            return NotImplemented
        return (self.steps, self.lr_values, self.lr_max) == (
            other.steps,
            other.lr_values,
            other.lr_max,
        )

    def __hash__(self) -> int:
        return hash((self.steps, self.lr_values, self.lr_max))

    def _knots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Knot steps from 0, their lr, and the cumulative integral of lr at each knot."""
        steps, lr = np.array(self.steps), np.array(self.lr_values)
        if steps[0] > 0:  # constant extrapolation down to step 0
            steps, lr = np.concatenate([[0.0], steps]), np.concatenate([[lr[0]], lr])
        cum = np.concatenate([[0.0], np.cumsum(np.diff(steps) * (lr[1:] + lr[:-1]) / 2.0)])
        return steps, lr, cum

    def lr(self, step: Any) -> float | np.ndarray:
        s, scalar = _steps_array(step)
        return _out(np.interp(s, self.steps, self.lr_values), scalar)

    def tau(self, step: Any) -> float | np.ndarray:
        s, scalar = _steps_array(step)
        knots, lr, cum = self._knots()
        i = np.clip(np.searchsorted(knots, s, side="right") - 1, 0, len(knots) - 1)
        lr_s = np.interp(s, knots, lr)
        area = cum[i] + (s - knots[i]) * (lr[i] + lr_s) / 2.0
        return _out(area / self.lr_max, scalar)

    def to_json(self) -> dict:
        return {
            "kind": "table",
            "steps": list(self.steps),
            "lr": list(self.lr_values),
            "lr_max": self.lr_max,
        }

    def describe(self) -> str:
        return (
            f"table({len(self.steps)} points, steps {self.steps[0]:g}..{self.steps[-1]:g}, "
            f"lr_max={self.lr_max:g})"
        )


Schedule = WarmupCosine | WarmupLinear | TableSchedule


_FIELDS = {
    "warmup_cosine": ({"lr_max", "warmup_steps", "total_steps"}, {"final_lr_ratio"}),
    "warmup_linear": ({"lr_max", "warmup_steps", "total_steps"}, {"final_lr_ratio"}),
    "table": ({"steps", "lr"}, {"lr_max"}),
}


def _per_step(lr: Any, lr_max: Any = None) -> TableSchedule:
    """A per-step list of learning rates (entry i is the lr of step i)."""
    if not isinstance(lr, list) or not lr:
        raise ScheduleError(f"a per-step schedule needs a non-empty list of learning rates; {ACCEPTED_FORMS}")
    return TableSchedule(range(len(lr)), lr, lr_max)


def _ignored(keys: set[str], form: str) -> None:
    """One warning naming the keys a schedule file carries beyond its form (training scripts
    write losses and saved steps beside the learning rates)."""
    if keys:
        warnings.warn(f"the schedule is read as {form}; ignored its other keys: {', '.join(sorted(keys))}",
                      CheckpointIndexWarning, stacklevel=3)


def schedule_from_json(obj: Any) -> Schedule:
    """Build a schedule from any JSON form in :data:`ACCEPTED_FORMS`."""
    if isinstance(obj, list):
        return _per_step(obj)
    if not isinstance(obj, dict):
        raise ScheduleError(f"a schedule must be a JSON object or list; {ACCEPTED_FORMS}")
    if "kind" not in obj:
        if {"steps", "lr"} <= set(obj):
            obj = {"kind": "table", **obj}
        elif "lr" in obj:
            _ignored(set(obj) - {"lr", "lr_max"}, "a per-step lr list")
            return _per_step(obj["lr"], obj.get("lr_max"))
        else:
            raise ScheduleError(f"schedule has fields {', '.join(sorted(obj)) or 'none'}; {ACCEPTED_FORMS}")
    kind = obj["kind"]
    if kind not in _FIELDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; {ACCEPTED_FORMS}")
    required, optional = _FIELDS[kind]
    keys = set(obj) - {"kind"}
    if missing := sorted(required - keys):
        raise ScheduleError(f"{kind} schedule is missing {', '.join(missing)}; {ACCEPTED_FORMS}")
    _ignored(keys - required - optional, f"a {kind} schedule")
    args = {k: obj[k] for k in keys & (required | optional)}
    try:
        if kind == "warmup_cosine":
            return WarmupCosine(**{k: float(v) for k, v in args.items()})
        if kind == "warmup_linear":
            return WarmupLinear(**{k: float(v) for k, v in args.items()})
        return TableSchedule(**args)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(f"{kind} schedule has a non-numeric field: {one_line(exc)}") from None


def schedule_from_csv(text: str) -> TableSchedule:
    """A table from CSV text with a step column and a learning-rate column (a W&B export works:
    ``_step`` / ``train/global_step`` and ``train/learning_rate``; rows with an empty lr are skipped)."""
    rows = list(csv.reader(text.splitlines()))
    if not rows:
        raise ScheduleError(f"the CSV schedule is empty; {ACCEPTED_FORMS}")
    header = [h.strip() for h in rows[0]]
    lower = [h.lower() for h in header]
    step_col = next((lower.index(c) for c in _CSV_STEP_COLUMNS if c in lower), None)
    lr_col = next((i for i, h in enumerate(lower)
                   if h in ("lr", "learning_rate") or h.endswith(("/lr", "/learning_rate", "learning_rate"))
                   and "__" not in h), None)
    if step_col is None or lr_col is None:
        raise ScheduleError(f"CSV columns {', '.join(header)} lack a step or a learning-rate column; {ACCEPTED_FORMS}")
    points: dict[float, float] = {}
    for n, row in enumerate(rows[1:], start=2):
        if len(row) <= max(step_col, lr_col) or not row[lr_col].strip() or not row[step_col].strip():
            continue
        try:
            step, lr = float(row[step_col]), float(row[lr_col])
        except ValueError:
            raise ScheduleError(f"CSV line {n} is not numeric ({row[step_col]!r}, {row[lr_col]!r}); {ACCEPTED_FORMS}") from None
        if math.isfinite(lr):
            points[step] = lr  # the last value logged at a step wins
    if not points:
        raise ScheduleError(f"the CSV schedule has no learning rates; {ACCEPTED_FORMS}")
    steps = sorted(points)
    return TableSchedule(steps, [points[s] for s in steps])


def read_schedule_file(path: str | Path) -> Schedule:
    """A schedule from a file: ``.csv``, a ``trainer_state.json``, or any JSON form."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".csv":
            return schedule_from_csv(path.read_text())
        obj = _read_json(path)
        if isinstance(obj, dict) and "log_history" in obj:
            schedule = schedule_from_trainer_state(obj)
            if schedule is None:
                raise ScheduleError(f"its log_history has no learning rates; {ACCEPTED_FORMS}")
            return schedule
        return schedule_from_json(obj)
    except ScheduleError as exc:
        msg = str(exc) if ACCEPTED_FORMS in str(exc) else f"{exc}; {ACCEPTED_FORMS}"
        raise ScheduleError(f"{path}: {msg}") from None


def schedule_from_trainer_state(state: dict) -> TableSchedule | None:
    """A table from an HF ``trainer_state.json`` (``log_history`` entries with learning_rate and step).

    Returns None when the log has no learning rates (then tau is unknown).
    """
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        return None
    points: dict[float, float] = {}
    for entry in history:
        if isinstance(entry, dict) and "learning_rate" in entry and "step" in entry:
            points[float(entry["step"])] = float(entry["learning_rate"])  # last one wins per step
    if not points or max(points.values()) <= 0:
        return None
    steps = sorted(points)
    return TableSchedule(tuple(steps), tuple(points[s] for s in steps))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ScheduleError(f"cannot read {path}: {one_line(exc)}; {ACCEPTED_FORMS}") from None


def _latest_trainer_state(folder: Path) -> Path | None:
    """``trainer_state.json`` of the highest ``checkpoint-<N>`` subfolder that has one."""
    best: tuple[int, Path] | None = None
    for sub in folder.iterdir():
        try:
            step = parse_trainer_folder(sub.name)
        except RevisionNameError:
            continue
        state = sub / TRAINER_STATE_FILE
        if state.is_file() and (best is None or step > best[0]):
            best = (step, state)
    return None if best is None else best[1]


def load_schedule(folder: str | Path) -> Schedule | None:
    """The schedule of a local run folder, or None when it has none.

    Looks for ``schedule.json`` then ``schedule.csv`` at the top, then ``trainer_state.json`` at the top, then the
    ``trainer_state.json`` of the latest ``checkpoint-<N>/`` (the HF Trainer writes one per
    checkpoint). A malformed ``schedule.json`` is an error; a trainer state without learning
    rates gives a warning and None.
    """
    folder = Path(folder)
    for name in (SCHEDULE_FILE, SCHEDULE_CSV):
        if (folder / name).is_file():
            return read_schedule_file(folder / name)
    state_path = folder / TRAINER_STATE_FILE
    if not state_path.is_file():
        state_path = _latest_trainer_state(folder) if folder.is_dir() else None
    if state_path is None:
        return None
    schedule = schedule_from_trainer_state(_read_json(state_path))
    if schedule is None:
        warnings.warn(
            f"{state_path} has no learning rates in log_history; tau is unknown "
            f"(add a {SCHEDULE_FILE}, see docs/architecture.md)",
            CheckpointIndexWarning,
            stacklevel=2,
        )
    return schedule
