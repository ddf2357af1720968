"""The exceptions and the warning raised by the checkpoint index.

Every error a user can cause is a ``ValueError`` subclass with a one-line message that says what
to do, so the command line can print it and exit non-zero without a traceback.
"""

from __future__ import annotations

from ..vocab import PeakprobeError, PeakprobeWarning


class CheckpointIndexError(PeakprobeError):
    """Base class of every user-facing error of ``peakprobe.checkpoints_index``."""


class RevisionNameError(CheckpointIndexError):
    """A revision or folder name does not follow the naming scheme it was parsed with."""


class ScheduleError(CheckpointIndexError):
    """A learning-rate schedule (JSON, table or trainer_state.json) is missing fields or invalid."""


class SelectionError(CheckpointIndexError):
    """A selection (n, spacing, steps, step range, revisions) cannot be satisfied."""


class UnknownRevisionError(SelectionError):
    """A requested step or revision is not in the checkpoint sequence."""


class DuplicateStepError(CheckpointIndexError):
    """Two checkpoints of one sequence share a step."""


class NoCheckpointsError(CheckpointIndexError):
    """A local folder holds no checkpoint subfolders (or does not exist)."""


class UnknownFamilyError(CheckpointIndexError):
    """A family name or size that peakprobe does not know."""


class OfflineError(CheckpointIndexError):
    """A hub id was given but the hub cannot be reached (offline mode or no connection)."""


class HubError(CheckpointIndexError):
    """The hub answered, but the repository is missing, gated, or has no checkpoint branches."""


class CheckpointIndexWarning(PeakprobeWarning):
    """Something was skipped while building an index (a subfolder, a branch, a duplicate)."""


def one_line(text: str) -> str:
    """Collapse whitespace so that an error message stays on one line."""
    return " ".join(str(text).split())
