"""``python -m peakprobe`` (and ``accelerate launch -m peakprobe``) runs the command line."""

from .cli import main

raise SystemExit(main())
