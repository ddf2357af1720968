"""Numbers and name lists as short text: the one number formatter (``num``, ``pct``) and the one
list shortener (``short_list``) shared by terminal lines, warnings and reports."""

from __future__ import annotations

from collections.abc import Iterable


def short_list(names: Iterable, limit: int = 5) -> str:
    """Names in one line: ``a, b, c``, or ``a, b, c, d, e and 3 more`` past ``limit`` (so a count
    said beside them always agrees with what is shown)."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
