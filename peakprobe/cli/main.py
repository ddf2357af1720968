"""The parser over the subcommand table, warning routing, and the mapping of errors to exit codes."""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
import warnings

from ..hf import quiet_transformers_progress
from ..vocab import PeakprobeError, PeakprobeWarning
from .commands import COMMANDS
from .options import add_verbosity, warn_deprecated


def _subparser(sub, name: str) -> argparse.ArgumentParser:
    cmd = COMMANDS[name]
    p = sub.add_parser(name, help=cmd.help, description=cmd.help, epilog="example:\n  " + cmd.example,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbosity(p)  # -q / -v work before or after the subcommand
    cmd.add(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``peakprobe`` parser: global -q / -v and one subparser per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="peakprobe",
        description="Find the softmax that bottlenecks training: per-head peakedness and logit "
        "growth across checkpoints, t^(1/3) fits, and a per-head report.",
        epilog="exit codes: 0 ok, 1 part of the work failed (or a bug), 2 bad input\n"
        "start with: peakprobe demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true",
                           help="no progress bars or summaries (warnings and errors still show)")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="show warnings and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _subparser(sub, name)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message).strip().splitlines()
    print(f"peakprobe: warning: {text[0] if text else category.__name__}", file=sys.stderr)


def _route_warnings(verbose: bool) -> None:
    """peakprobe's own warnings once each, as one line, also under -q (which silences progress
    and summaries, not what a user must know); other libraries' warnings hidden unless -v,
    which shows every warning with its origin."""
    if verbose:
        warnings.simplefilter("default")
        return
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=PeakprobeWarning)
    warnings.showwarning = _one_line_warning  # restored by catch_warnings in main
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure or bug, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    command = "peakprobe " + shlex.join(argv)
    try:
        with warnings.catch_warnings():
            _route_warnings(args.verbose)
            warn_deprecated(args)
            with quiet_transformers_progress():  # a command's own bars count its work
                return COMMANDS[args.command].run(args, command)
    except KeyboardInterrupt:
        print("peakprobe: interrupted; finished checkpoints are kept, re-run to resume", file=sys.stderr)
        return 1
    except PeakprobeError as exc:  # the user's input: one line, exit 2
        if args.verbose:
            traceback.print_exc()
        print(f"peakprobe: error: {_first_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # anything else is a bug in peakprobe, not the user's mistake
        if args.verbose:
            traceback.print_exc()
        print(f"peakprobe: internal error (a bug in peakprobe, not your input): "
              f"{type(exc).__name__}: {_first_line(exc)}; re-run with -v for the traceback",
              file=sys.stderr)
        return 1
