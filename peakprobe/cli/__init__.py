"""The ``peakprobe`` command line: ``main(argv)`` (the console script and ``python -m peakprobe``).

The subcommands are ``commands.COMMANDS``; their options are built from the configuration records
(``options``). Exit codes: 0 success; 1 the work ran but part of it failed (checkpoints in
failures.jsonl, a fit skipped for lack of points), or a bug in peakprobe (one line saying so;
``-v`` shows the traceback); 2 bad input (``vocab.PeakprobeError``: unknown family, missing
folder, bad option, empty data, a model peakprobe cannot probe), one line on stderr.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
