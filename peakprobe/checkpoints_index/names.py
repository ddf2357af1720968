"""Revision and folder-name parsers: step (and tokens, where the name says) from a name.

Naming schemes handled:

- Pythia / plain step folders: ``step1000``; local folders may carry a prefix: ``run-step1000``.
- HF Trainer output folders: ``checkpoint-500``.
- OLMo-1 branches: ``step1000-tokens4B``.
- OLMo-2 branches: ``stage1-step140000-tokens588B``, ``stage2-ingredient1-step11931-tokens50B``,
  and the same without the stage prefix. The token count in a name is rounded by its writer
  (``4B`` = 4 x 10^9), so it is approximate.
- LLM360 Amber branches: ``ckpt_000`` ... ``ckpt_358`` (``main`` is checkpoint 359). The name
  gives only the checkpoint index; tokens per checkpoint are not stated in our reference, so
  Amber tokens are reported as unknown (None).

Each parser raises :class:`RevisionNameError` with a one-line message on a malformed name.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import NamedTuple

from .errors import RevisionNameError

AMBER_N_CHECKPOINTS = 360
AMBER_MAIN_INDEX = AMBER_N_CHECKPOINTS - 1

_SCALE = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_TOKENS = r"tokens(?P<amount>\d+(?:\.\d+)?)(?P<unit>[KMBTkmbt])"
_OLMO1_RE = re.compile(rf"step(?P<step>\d+)-{_TOKENS}")
_OLMO2_RE = re.compile(
    rf"(?:stage(?P<stage>\d+)-)?(?:ingredient(?P<ingredient>\d+)-)?step(?P<step>\d+)-{_TOKENS}"
)
_AMBER_RE = re.compile(r"ckpt_(?P<index>\d{3})")
_TRAINER_RE = re.compile(r"checkpoint-(?P<step>\d+)")
_STEP_FOLDER_RE = re.compile(r"(?:.+-)?step(?P<step>\d+)")
_PYTHIA_RE = re.compile(r"step(?P<step>\d+)")


class Olmo2Revision(NamedTuple):
    """An OLMo-2 branch name, parsed. ``stage`` is 1 when the name has no stage prefix."""

    step: int
    tokens: int
    stage: int
    ingredient: int | None


def _tokens(amount: str, unit: str) -> int:
    """``("4", "B")`` -> 4_000_000_000; decimals are converted exactly, then rounded."""
    return int((Decimal(amount) * _SCALE[unit.upper()]).to_integral_value())


def _check_str(name: object, scheme: str) -> str:
    if not isinstance(name, str):
        raise RevisionNameError(
            f"{scheme} revision name must be a string, got {type(name).__name__}"
        )
    return name


def parse_pythia_revision(name: str) -> int:
    """``"step1000"`` -> 1000 (Pythia branch names)."""
    m = _PYTHIA_RE.fullmatch(_check_str(name, "Pythia"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not a Pythia revision; expected step<N>, e.g. step1000"
        )
    return int(m["step"])


def parse_olmo1_revision(name: str) -> tuple[int, int]:
    """``"step1000-tokens4B"`` -> ``(1000, 4_000_000_000)``."""
    m = _OLMO1_RE.fullmatch(_check_str(name, "OLMo-1"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not an OLMo-1 revision; expected step<N>-tokens<X><K|M|B|T>, "
            "e.g. step1000-tokens4B"
        )
    return int(m["step"]), _tokens(m["amount"], m["unit"])


def parse_olmo2_revision(name: str) -> Olmo2Revision:
    """``"stage1-step1000-tokens5B"`` -> ``Olmo2Revision(1000, 5_000_000_000, 1, None)``.

    Also accepts ``stage2-ingredient1-step11931-tokens50B`` and names without a stage prefix
    (taken as stage 1). In stage 2 the step and token counters restart for every ingredient.
    """
    m = _OLMO2_RE.fullmatch(_check_str(name, "OLMo-2"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not an OLMo-2 revision; expected [stage<S>-][ingredient<I>-]step<N>-"
            "tokens<X><K|M|B|T>, e.g. stage1-step140000-tokens588B"
        )
    stage = int(m["stage"]) if m["stage"] is not None else 1
    ingredient = int(m["ingredient"]) if m["ingredient"] is not None else None
    return Olmo2Revision(int(m["step"]), _tokens(m["amount"], m["unit"]), stage, ingredient)


def olmo2_line(name: str) -> str:
    """The training line a parsed OLMo-2 branch belongs to: ``stage1`` or ``stage2-ingredient1``."""
    rev = parse_olmo2_revision(name)
    line = f"stage{rev.stage}"
    return line if rev.ingredient is None else f"{line}-ingredient{rev.ingredient}"


def parse_amber_revision(name: str) -> int:
    """``"ckpt_000"`` -> 0 ... ``"ckpt_359"`` -> 359 (the checkpoint index, not an optimizer step)."""
    m = _AMBER_RE.fullmatch(_check_str(name, "Amber"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not an LLM360 Amber revision; expected ckpt_NNN (three digits), e.g. ckpt_042"
        )
    index = int(m["index"])
    if index > AMBER_MAIN_INDEX:
        raise RevisionNameError(
            f"{name!r} is out of range: Amber has {AMBER_N_CHECKPOINTS} checkpoints, "
            f"ckpt_000 to ckpt_{AMBER_MAIN_INDEX:03d}"
        )
    return index


def parse_trainer_folder(name: str) -> int:
    """``"checkpoint-500"`` -> 500 (Hugging Face Trainer output folders)."""
    m = _TRAINER_RE.fullmatch(_check_str(name, "Trainer"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not an HF Trainer checkpoint folder; expected checkpoint-<N>, e.g. checkpoint-500"
        )
    return int(m["step"])


def parse_step_folder(name: str) -> int:
    """``"step1000"`` or ``"<anything>-step1000"`` -> 1000."""
    m = _STEP_FOLDER_RE.fullmatch(_check_str(name, "step-folder"))
    if m is None:
        raise RevisionNameError(
            f"{name!r} is not a step folder; expected step<N> or <name>-step<N>, e.g. run-step1000"
        )
    return int(m["step"])


def parse_local_folder(name: str) -> tuple[int, int | None]:
    """Step (and tokens when the name carries them) of a local checkpoint folder name.

    Tries, in order: ``step<N>`` / ``<name>-step<N>``, ``checkpoint-<N>``, and OLMo-style
    ``[stage<S>-]step<N>-tokens<X>B`` (a local mirror of hub branches).
    """
    for parser in (parse_step_folder, parse_trainer_folder):
        try:
            return parser(name), None
        except RevisionNameError:
            pass
    try:
        rev = parse_olmo2_revision(name)
    except RevisionNameError:
        raise RevisionNameError(
            f"{name!r} is not a checkpoint folder name; expected step<N>, <name>-step<N> or checkpoint-<N>"
        ) from None
    return rev.step, rev.tokens
