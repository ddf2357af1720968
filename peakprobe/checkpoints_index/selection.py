"""Choosing checkpoints among those available: the HF cache offline, the hub (or built-in
table) online; the default Pythia selection; a user schedule replacing the built-in one.

Selections never fail because some requested checkpoints are missing while others are there:
they return what is available and one line saying what was requested but is missing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from ..formatting import short_list
from .cache import cached_refs
from .errors import CheckpointIndexWarning, OfflineError, SelectionError, UnknownRevisionError
from .families import pythia_default_steps
from .hub import check_hub_reachable, offline_requested
from .records import Checkpoint, CheckpointSequence
from .schedules import Schedule


def restrict_to_cache(seq: CheckpointSequence) -> CheckpointSequence:
    """The hub revisions of ``seq`` held in the local HF cache (local folders are kept)."""
    refs = cached_refs(seq.source)
    return replace(seq, checkpoints=[c for c in seq if c.path is not None or c.revision in refs])


def with_schedule(seq: CheckpointSequence, schedule: Schedule) -> CheckpointSequence:
    """``seq`` with tau recomputed from ``schedule`` (a user's own LR log)."""
    checkpoints = [replace(c, tau=float(schedule.tau(c.step))) for c in seq]
    return replace(seq, checkpoints=checkpoints, schedule=schedule)


@dataclass(frozen=True)
class Selection:
    """Which checkpoints to take: the arguments of ``CheckpointSequence.select``. Each field's
    ``metadata`` is its command-line face (``peakprobe.cli.options``)."""

    n: int | None = field(default=None, metadata={
        "help": "pick N checkpoints (first and last included)", "flag": "--select", "metavar": "N"})
    spacing: str = field(default="log", metadata={
        "help": "spacing of --select (default %(default)s)", "choices": ("log", "linear")})
    steps: list[int] | None = field(default=None, metadata={"help": "explicit steps, comma-separated"})
    step_range: tuple[int, int] | None = field(default=None, metadata={
        "help": "only steps in [A, B]", "metavar": "A:B"})
    revisions: list[str] | None = field(default=None, metadata={
        "help": "explicit revisions, comma-separated"})

    @property
    def empty(self) -> bool:
        """Nothing was asked for (each family's default selection applies)."""
        return self.n is None and not (self.steps or self.step_range or self.revisions)


def select_available(
    full: CheckpointSequence, available: CheckpointSequence, *, where: str,
    selection: Selection = Selection(), complete: bool = True,
) -> tuple[CheckpointSequence, str | None]:
    """Select among ``available`` (a subset of ``full``); returns the selection and a one-line
    note on what was requested but is not available (None when nothing is missing).

    A step or revision unknown to ``full`` is an error (a typo) when ``full`` is the complete
    list (built-in table, hub listing), and merely missing when ``full`` is itself what the cache
    holds (``complete=False``). With no selection at all, Pythia gets its default (the authors'
    steps plus log-spaced fill), others everything."""
    if not len(available):
        raise SelectionError(f"none of the {len(full)} revisions of {full.name} is {where}")
    have = set(available.revisions)
    note = None
    n, steps, step_range, revisions = selection.n, selection.steps, selection.step_range, selection.revisions
    if steps is not None or revisions is not None:
        keys = sorted(set(int(s) for s in steps)) if steps is not None else list(dict.fromkeys(revisions))
        missing, present = [], []
        for key in keys:
            try:
                c: Checkpoint = full.by_step(key) if steps is not None else full.by_revision(key)
            except UnknownRevisionError:
                if complete:
                    raise
                missing.append(f"step {key}" if steps is not None else key)
                continue
            (present if c.revision in have else missing).append(c.revision)
        if not present:
            raise SelectionError(f"none of the requested revisions of {full.name} is {where} "
                                 f"(missing: {short_list(missing)})")
        if missing:
            note = f"{len(missing)} requested revisions are not {where} and are skipped: {short_list(missing)}"
        return available.select(revisions=present), note
    if n is None and step_range is None:
        if full.family == "pythia":
            return available.select(steps=pythia_default_steps(available.steps)), None
        return available, None
    picked = available.select(n=n, spacing=selection.spacing, step_range=step_range)
    if n is not None and len(picked) < n and len(available) < n:
        note = (f"requested {n} checkpoints, selected {len(picked)}: only {len(available)} of the "
                f"{len(full)} revisions of {full.name} are {where}")
    return picked, note


@dataclass(frozen=True)
class Availability:
    """What can be probed of a sequence now: ``seq`` (the available checkpoints), ``where`` they
    are (for messages: "on the hub", "in the HF cache", "available"), ``offline`` (read from the
    HF cache only)."""

    seq: CheckpointSequence
    where: str
    offline: bool


def available(seq: CheckpointSequence, *, check_hub: bool) -> Availability:
    """The checkpoints of ``seq`` that can be loaded: local folders as they are; hub revisions
    from the HF cache when offline (``HF_HUB_OFFLINE=1``) or when the hub does not answer and the
    cache holds some (``check_hub``: ask the hub first; one warning says the cache is used);
    else every revision, from the hub. Offline with nothing cached and no hub check (listing),
    the sequence itself (the built-in table)."""
    if all(c.path is not None for c in seq):
        return Availability(seq, "available", False)
    offline = offline_requested()
    if not offline and check_hub:
        try:
            check_hub_reachable(seq.source)
        except OfflineError:
            if not cached_refs(seq.source):
                raise
            warnings.warn(f"the hub is unreachable: using the revisions of {seq.source} in the HF cache",
                          CheckpointIndexWarning, stacklevel=2)
            offline = True
    if offline:
        cached = restrict_to_cache(seq)
        if len(cached) or check_hub:
            return Availability(cached, "in the HF cache", True)
        return Availability(seq, "available", True)
    return Availability(seq, "on the hub", False)
