"""Command-line options built from the configuration records, and the records built back from
the parsed options: one source for every option's default, type and help.

A record is a dataclass (``peakprobe.config``, ``checkpoints_index.Selection``) whose fields
carry their command-line face in ``metadata`` (``help``, ``flag``, ``choices``, ``metavar``,
``cli``). The field's annotation gives the parser: ``int``, ``float``, ``str``, comma-separated
``list[int]`` / ``list[str]``, ``A:B`` for ``tuple[int, int]``, ``LO,HI`` for the band; a bool is
a switch (``--no-...`` for one that is on by default). ``add_record`` adds a record's fields to a
parser group under destinations of its own; ``record_from`` rebuilds the record.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable

from ..config import ConfigError, parse_band
from ..vocab import PeakprobeWarning


def _int_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [s for s in text.replace(" ", "").split(",") if s]


def _int_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two integers), got {text!r}") from None


def _band(text: str) -> tuple[float, float]:
    try:
        return parse_band(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: a field's annotation (without ``| None``) -> the parser of its option's text
PARSERS: dict[str, Callable[[str], object]] = {
    "int": int,
    "float": float,
    "str": str,
    "list[int]": _int_list,
    "list[str]": _str_list,
    "tuple[int, int]": _int_range,
    "tuple[float, float]": _band,
}


def _base_type(annotation: object) -> str:
    text = str(annotation).replace("typing.", "")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    return parts[0] if len(parts) == 1 else text


def cli_fields(record: type, only: Iterable[str] | None = None) -> list[dataclasses.Field]:
    """The fields of ``record`` that are command-line options (all, or those named in ``only``)."""
    names = None if only is None else set(only)
    return [f for f in dataclasses.fields(record)
            if f.metadata.get("cli", True) and "help" in f.metadata and (names is None or f.name in names)]


def _dest(key: str, name: str) -> str:
    return f"{key}__{name}"


def add_record(group: argparse._ActionsContainer, record: type, key: str,
               only: Iterable[str] | None = None) -> None:
    """Add an option for each command-line field of ``record`` to ``group``; the parsed values
    land in ``args.<key>__<field>`` (``record_from`` reads them back)."""
    for f in cli_fields(record, only):
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        kwargs: dict = {"dest": _dest(key, f.name), "help": meta["help"]}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        kind = _base_type(f.type)
        if kind == "bool":
            kwargs["action"] = "store_false" if f.default else "store_true"
            kwargs["default"] = f.default
        else:
            if kind not in PARSERS:
                raise TypeError(f"{record.__name__}.{f.name}: no command-line parser for {f.type!r}")
            kwargs["type"] = PARSERS[kind]
            kwargs["default"] = f.default
            if meta.get("choices"):
                kwargs["choices"] = tuple(meta["choices"])
            else:
                kwargs.setdefault("metavar", f.name.upper())
        group.add_argument(flag, **kwargs)


def record_from(args: argparse.Namespace, record: type, key: str, only: Iterable[str] | None = None,
                **fixed):
    """``record`` built from the options ``add_record`` added under ``key`` (fields that are no
    options, or not in ``only``, keep their defaults unless given in ``fixed``)."""
    values = {f.name: getattr(args, _dest(key, f.name)) for f in cli_fields(record, only)
              if hasattr(args, _dest(key, f.name))}
    return record(**{**values, **fixed})


def add_verbosity(p: argparse.ArgumentParser) -> None:
    """-q / -v on a subcommand's parser, so they work after the subcommand too (the global
    parser's own -q / -v show in its help)."""
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class DeprecatedSwitch(argparse.Action):
    """A switch kept for one release under its old name: it stores ``const`` in ``dest`` like the
    new switch and leaves a note in ``args.deprecated`` (``warn_deprecated`` says it once)."""

    def __init__(self, option_strings, dest, *, instead: str, const, **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)
        notes = list(getattr(namespace, "deprecated", []))
        note = f"{option_string} is deprecated and will be removed; use {self.instead}"
        namespace.deprecated = notes + ([note] if note not in notes else [])


def warn_deprecated(args: argparse.Namespace) -> None:
    """One warning for each deprecated option given (``DeprecatedSwitch``)."""
    import warnings

    for note in getattr(args, "deprecated", []):
        warnings.warn(note, PeakprobeWarning, stacklevel=2)
