"""Local runs: a folder of ``save_pretrained`` checkpoint subfolders as a CheckpointSequence.

Subfolders named ``step<N>/``, ``checkpoint-<N>/`` (HF Trainer) or ``<name>-step<N>/`` (and
OLMo-style ``step<N>-tokens<X>B/`` mirrors, which also give tokens) are checkpoints when they hold
a ``config.json``. Anything else is skipped with a :class:`CheckpointIndexWarning`; hidden folders
and plain files are ignored silently. tau comes from the folder's schedule (see
:func:`load_schedule`) when there is one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..formatting import short_list
from .errors import CheckpointIndexWarning, NoCheckpointsError, RevisionNameError
from .names import parse_local_folder
from .records import Checkpoint, CheckpointSequence
from .schedules import load_schedule

CONFIG_FILE = "config.json"
LAYOUT_HINT = "expected subfolders step<N>/, checkpoint-<N>/ or <name>-step<N>/, each a save_pretrained folder with config.json"


def from_local(folder: str | Path) -> CheckpointSequence:
    """The checkpoint sequence of a local run folder, sorted by step, each checkpoint's path set."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise NoCheckpointsError(f"{root} is not a folder; {LAYOUT_HINT}")
    root = root.resolve()
    schedule = load_schedule(root)
    found: list[tuple[int, int | None, Path]] = []
    unnamed: list[str] = []
    no_config: list[str] = []
    for sub in sorted(root.iterdir()):
        if not sub.is_dir() or sub.name.startswith("."):
            continue
        try:
            step, tokens = parse_local_folder(sub.name)
        except RevisionNameError:
            unnamed.append(sub.name)
            continue
        if not (sub / CONFIG_FILE).is_file():
            no_config.append(sub.name)
            continue
        found.append((step, tokens, sub))
    if unnamed:
        warnings.warn(
            f"{root}: skipped subfolders not named like checkpoints: {short_list(sorted(unnamed), limit=8)} ({LAYOUT_HINT})",
            CheckpointIndexWarning,
            stacklevel=2,
        )
    if no_config:
        warnings.warn(
            f"{root}: skipped checkpoint-named subfolders without {CONFIG_FILE}: {short_list(sorted(no_config), limit=8)}",
            CheckpointIndexWarning,
            stacklevel=2,
        )
    if not found:
        if (root / CONFIG_FILE).is_file():
            raise NoCheckpointsError(
                f"{root} is a single checkpoint (it has {CONFIG_FILE}); point at the folder that holds "
                "its step<N>/ siblings instead"
            )
        raise NoCheckpointsError(f"{root} has no checkpoints; {LAYOUT_HINT}")
    checkpoints = [
        Checkpoint(
            revision=sub.name,
            step=step,
            tokens=tokens,
            tau=None if schedule is None else float(schedule.tau(step)),
            path=str(sub),
        )
        for step, tokens, sub in found
    ]
    return CheckpointSequence(
        name=root.name, source=str(root), checkpoints=checkpoints, schedule=schedule, family=None
    )
