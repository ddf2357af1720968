"""The index records: a :class:`Checkpoint` and an ordered :class:`CheckpointSequence`.

A sequence is sorted by step with no two checkpoints sharing a step. It knows how to select a
subset (log- or linearly spaced, explicit steps or revisions, a step range), how to become a
pandas frame, and how to print itself as an aligned table
(:func:`format_index`, used by ``peakprobe index``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from .errors import DuplicateStepError, SelectionError, UnknownRevisionError
from .schedules import Schedule

if TYPE_CHECKING:
    import pandas

SPACINGS = ("log", "linear")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: its revision (branch or folder name), step, tokens seen, dynamic time tau.

    ``tokens`` / ``tau`` are None when unknown; ``path`` is the local folder of a local run.
    """

    revision: str
    step: int
    tokens: int | None
    tau: float | None
    path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.revision, str) or not self.revision:
            raise ValueError(
                f"checkpoint revision must be a non-empty string, got {self.revision!r}"
            )
        if (
            isinstance(self.step, bool)
            or not isinstance(self.step, (int, np.integer))
            or self.step < 0
        ):
            raise ValueError(f"checkpoint step must be an integer >= 0, got {self.step!r}")
        object.__setattr__(self, "step", int(self.step))
        if self.tokens is not None:
            object.__setattr__(self, "tokens", int(self.tokens))
        if self.tau is not None:
            object.__setattr__(self, "tau", float(self.tau))

    def to_dict(self) -> dict:
        """The manifest form: ``{"revision", "step", "tokens", "tau", "path"}``."""
        return asdict(self)


@dataclass
class CheckpointSequence:
    """An ordered list of checkpoints of one model, with where it came from and its schedule.

    ``source`` is a hub id or a local folder; ``family`` is ``pythia``, ``olmo1``, ``olmo2``,
    ``amber`` or None (a local run or an unrecognised repo). ``fit_start_step`` is a built-in
    family's default first step of the fit window (None: the fits choose).
    """

    name: str
    source: str
    checkpoints: list[Checkpoint] = field(default_factory=list)
    schedule: Schedule | None = None
    family: str | None = None
    fit_start_step: int | None = None

    def __post_init__(self) -> None:
        self.checkpoints = sorted(self.checkpoints, key=lambda c: c.step)
        for a, b in pairwise(self.checkpoints):
            if a.step == b.step:
                raise DuplicateStepError(
                    f"{self.name}: revisions {a.revision!r} and {b.revision!r} both have step {a.step}; "
                    "keep only one of them"
                )

    def __len__(self) -> int:
        return len(self.checkpoints)

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self.checkpoints)

    def __getitem__(self, index: int) -> Checkpoint:
        return self.checkpoints[index]

    @property
    def steps(self) -> list[int]:
        return [c.step for c in self.checkpoints]

    @property
    def revisions(self) -> list[str]:
        return [c.revision for c in self.checkpoints]

    def _with(self, checkpoints: list[Checkpoint]) -> CheckpointSequence:
        return replace(self, checkpoints=checkpoints)

    def by_revision(self, revision: str) -> Checkpoint:
        """The checkpoint named ``revision``; a clear error naming close ones if there is none."""
        for c in self.checkpoints:
            if c.revision == revision:
                return c
        hint = _nearest_names(self, revision)
        raise UnknownRevisionError(f"revision {revision!r} is not in {self.name}; {hint}")

    def by_step(self, step: int) -> Checkpoint:
        """The checkpoint at ``step``; a clear error naming the nearest available ones otherwise."""
        for c in self.checkpoints:
            if c.step == step:
                return c
        raise UnknownRevisionError(
            f"step {step} is not in {self.name}; {_nearest_steps(self, step)}"
        )

    def select(
        self,
        n: int | None = None,
        spacing: str = "log",
        steps: list[int] | None = None,
        step_range: tuple[int, int] | None = None,
        revisions: list[str] | None = None,
    ) -> CheckpointSequence:
        """A sub-sequence.

        ``steps`` or ``revisions`` pick exactly those checkpoints (an unknown one is an error that
        names the nearest available); they cannot be combined with ``n`` or ``step_range``.
        Otherwise ``step_range=(lo, hi)`` keeps lo <= step <= hi, then ``n`` keeps the checkpoints
        nearest to ``n`` targets spaced evenly in log(1 + step) (``"log"``) or in step
        (``"linear"``) between the first and last step, always including both; picks that fall
        on the same checkpoint count once, so fewer than ``n`` may come back where checkpoints
        are sparser than the targets.
        """
        if spacing not in SPACINGS:
            raise SelectionError(f"unknown spacing {spacing!r}; use one of {', '.join(SPACINGS)}")
        explicit = [
            name for name, v in (("steps", steps), ("revisions", revisions)) if v is not None
        ]
        if len(explicit) == 2 or (explicit and (n is not None or step_range is not None)):
            raise SelectionError(
                "give either explicit steps/revisions or n and/or step_range, not both"
            )
        if steps is not None:
            return self._with([self.by_step(int(s)) for s in sorted(set(steps))])
        if revisions is not None:
            return self._with([self.by_revision(r) for r in dict.fromkeys(revisions)])
        picked = list(self.checkpoints)
        if step_range is not None:
            lo, hi = step_range
            if lo > hi:
                raise SelectionError(
                    f"step range ({lo}, {hi}) is empty: the first step must be <= the second"
                )
            picked = [c for c in picked if lo <= c.step <= hi]
            if not picked:
                raise SelectionError(
                    f"no checkpoint of {self.name} lies in steps {lo}..{hi}; "
                    f"available steps run {self.steps[0]}..{self.steps[-1]}"
                    if self.checkpoints
                    else f"{self.name} has no checkpoints"
                )
        if n is not None:
            picked = _spaced(picked, n, spacing)
        return self._with(picked)

    def to_frame(self) -> pandas.DataFrame:
        """One row per checkpoint: revision, step, tokens (nullable Int64), tau (NaN if unknown), path."""
        import pandas as pd  # imported here so that listing an index stays fast

        return pd.DataFrame(
            {
                "revision": pd.Series([c.revision for c in self], dtype="string"),
                "step": pd.Series([c.step for c in self], dtype="int64"),
                "tokens": pd.Series([c.tokens for c in self], dtype="Int64"),
                "tau": pd.Series(
                    [np.nan if c.tau is None else c.tau for c in self], dtype="float64"
                ),
                "path": pd.Series([c.path for c in self], dtype="object"),
            }
        )


def _spaced(checkpoints: list[Checkpoint], n: int, spacing: str) -> list[Checkpoint]:
    """Checkpoints nearest to ``n`` evenly spaced targets (in log1p(step) or step), deduplicated."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise SelectionError(
            f"n must be an integer >= 2 (first and last are always kept), got {n!r}"
        )
    if n >= len(checkpoints):
        return list(checkpoints)
    steps = np.array([c.step for c in checkpoints], dtype=np.float64)
    axis = np.log1p(steps) if spacing == "log" else steps
    targets = np.linspace(axis[0], axis[-1], n)
    nearest = np.abs(axis[None, :] - targets[:, None]).argmin(axis=1)  # (n,)
    keep = sorted(set(nearest.tolist()) | {0, len(checkpoints) - 1})
    return [checkpoints[i] for i in keep]


def _nearest_steps(seq: CheckpointSequence, step: int) -> str:
    if not seq.checkpoints:
        return f"{seq.name} has no checkpoints"
    below = [c for c in seq if c.step < step]
    above = [c for c in seq if c.step > step]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    names = [
        c.revision if c.revision == f"step{c.step}" else f"{c.revision} (step {c.step})"
        for c in near
    ]
    return "nearest available: " + ", ".join(names)


def _nearest_names(seq: CheckpointSequence, revision: str) -> str:
    if not seq.checkpoints:
        return f"{seq.name} has no checkpoints"
    digits = "".join(ch for ch in revision if ch.isdigit())
    if digits:
        return _nearest_steps(seq, int(digits))
    return f"revisions run from {seq.revisions[0]} to {seq.revisions[-1]} ({len(seq)} in all)"


def _format_tokens(tokens: int | None) -> str:
    return "-" if tokens is None else f"{tokens:,}"


def _format_tau(tau: float | None) -> str:
    if tau is None or (isinstance(tau, float) and math.isnan(tau)):
        return "-"
    return f"{tau:.6g}"


def format_index(seq: CheckpointSequence) -> str:
    """An aligned text table of a sequence (revision, step, tokens, tau[, path]) with a title line."""
    schedule = (
        seq.schedule.describe() if seq.schedule is not None else "unknown (tau not available)"
    )
    family = seq.family or "local/unrecognised"
    title = f"{seq.name}  source={seq.source}  family={family}  checkpoints={len(seq)}  schedule={schedule}"
    header = ["revision", "step", "tokens", "tau"]
    rows = [[c.revision, str(c.step), _format_tokens(c.tokens), _format_tau(c.tau)] for c in seq]
    with_path = any(c.path is not None for c in seq)
    if with_path:
        header.append("path")
        for row, c in zip(rows, seq, strict=True):
            row.append(c.path or "-")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 2, 3}  # numbers are right-aligned

    def line(cells: list[str]) -> str:
        parts = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(r) for r in rows)])
