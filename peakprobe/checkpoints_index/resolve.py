"""``resolve(spec)``: turn what a user typed (a folder, a family name, a hub id) into a sequence.

Order: an existing local folder; a built-in Pythia name (``pythia-70m``, ``pythia-70m-deduped``,
``EleutherAI/pythia-160m``; offline, no network); any other ``owner/name`` hub id (listed online);
anything else is an :class:`UnknownFamilyError` that lists what is known.
"""

from __future__ import annotations

from pathlib import Path

from .errors import NoCheckpointsError, UnknownFamilyError
from .families import KNOWN_FAMILIES_TEXT, match_pythia, pythia
from .hub import HUB_ID_RE, from_hub
from .local import LAYOUT_HINT, from_local
from .records import CheckpointSequence

_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def resolve(
    spec: str | Path, *, token: str | None = None, stage: str | None = None
) -> CheckpointSequence:
    """The checkpoint sequence named by ``spec`` (folder, built-in family, or hub id)."""
    text = str(spec).strip()
    if not text:
        raise UnknownFamilyError(f"no model family or folder given; known: {KNOWN_FAMILIES_TEXT}")
    path = Path(text).expanduser()
    if path.is_dir():
        return from_local(path)
    if path.exists():
        raise NoCheckpointsError(f"{text} is a file, not a folder; {LAYOUT_HINT}")
    if isinstance(spec, Path) or text.startswith(_PATH_PREFIXES) or text.count("/") > 1:
        raise NoCheckpointsError(f"folder {text} does not exist; {LAYOUT_HINT}")
    match = match_pythia(text)
    if match is not None:
        return pythia(match[0], deduped=match[1], seed=match[2])
    if HUB_ID_RE.fullmatch(text):
        return from_hub(text, token=token, stage=stage)
    raise UnknownFamilyError(
        f"unknown model family or folder {text!r}; known: {KNOWN_FAMILIES_TEXT}"
    )
