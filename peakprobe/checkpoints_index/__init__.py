"""Checkpoint index: which revisions a model family has, with step, tokens and dynamic time tau.

Built-in Pythia tables (offline), OLMo-1 / OLMo-2 / Amber revision-name parsers, local run
folders with an optional learning-rate schedule, hub branch listing, and selection of a subset.
The sweep and the command line use :func:`resolve`, :meth:`CheckpointSequence.select` and
:func:`format_index`.
"""

from .errors import (
    CheckpointIndexError,
    CheckpointIndexWarning,
    DuplicateStepError,
    HubError,
    NoCheckpointsError,
    OfflineError,
    RevisionNameError,
    ScheduleError,
    SelectionError,
    UnknownFamilyError,
    UnknownRevisionError,
)
from .families import (
    BUILTIN_FAMILIES_TEXT,
    KNOWN_FAMILIES_TEXT,
    LOCAL_FOLDER_TEXT,
    PYTHIA_DEDUPED_SIZES,
    PYTHIA_LR_MAX,
    PYTHIA_NAMES,
    PYTHIA_SHAPES,
    PYTHIA_SIZES,
    PYTHIA_STEPS,
    PYTHIA_TOKENS_PER_STEP,
    ModelShape,
    pythia,
    pythia_schedule,
)
from .hub import check_hub_reachable, from_hub, sequence_from_branches
from .local import from_local
from .names import (
    Olmo2Revision,
    parse_amber_revision,
    parse_local_folder,
    parse_olmo1_revision,
    parse_olmo2_revision,
    parse_pythia_revision,
    parse_step_folder,
    parse_trainer_folder,
)
from .records import Checkpoint, CheckpointSequence, format_index
from .resolve import resolve
from .schedules import (
    Schedule,
    TableSchedule,
    WarmupCosine,
    load_schedule,
    schedule_from_json,
    schedule_from_trainer_state,
)

__all__ = [
    "BUILTIN_FAMILIES_TEXT",
    "KNOWN_FAMILIES_TEXT",
    "LOCAL_FOLDER_TEXT",
    "PYTHIA_DEDUPED_SIZES",
    "PYTHIA_LR_MAX",
    "PYTHIA_NAMES",
    "PYTHIA_SHAPES",
    "PYTHIA_SIZES",
    "PYTHIA_STEPS",
    "PYTHIA_TOKENS_PER_STEP",
    "Checkpoint",
    "CheckpointIndexError",
    "CheckpointIndexWarning",
    "CheckpointSequence",
    "DuplicateStepError",
    "HubError",
    "ModelShape",
    "NoCheckpointsError",
    "OfflineError",
    "Olmo2Revision",
    "RevisionNameError",
    "Schedule",
    "ScheduleError",
    "SelectionError",
    "TableSchedule",
    "UnknownFamilyError",
    "UnknownRevisionError",
    "WarmupCosine",
    "check_hub_reachable",
    "format_index",
    "from_hub",
    "from_local",
    "load_schedule",
    "parse_amber_revision",
    "parse_local_folder",
    "parse_olmo1_revision",
    "parse_olmo2_revision",
    "parse_pythia_revision",
    "parse_step_folder",
    "parse_trainer_folder",
    "pythia",
    "pythia_schedule",
    "resolve",
    "schedule_from_json",
    "schedule_from_trainer_state",
    "sequence_from_branches",
]
