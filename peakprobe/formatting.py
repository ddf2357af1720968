"""Numbers and name lists as short text: the one number formatter (``num``, ``pct``) and the one
list shortener (``short_list``) shared by terminal lines, warnings and reports."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def short_list(names: Iterable, limit: int = 5) -> str:
    """Names in one line: ``a, b, c``, or ``a, b, c, d, e and 3 more`` past ``limit`` (so a count
    said beside them always agrees with what is shown)."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def num(x: Any, fmt: str = ".3g", missing: str = "—") -> str:
    """A number as text: a float with ``fmt``; an integer, a bool or a string as it is;
    ``missing`` for None, NaN and infinities."""
    if x is None:
        return missing
    if isinstance(x, (numbers.Integral, str)):  # bools and numpy integers too
        return str(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return format(v, fmt) if math.isfinite(v) else missing


def pct(x: Any, fmt: str = ".3g", missing: str = "—") -> str:
    """A share as a percentage (``fmt`` applies to 100 x); ``missing`` for None, NaN and
    infinities."""
    if x is None or isinstance(x, str):
        return missing
    v = float(x)
    return f"{format(100.0 * v, fmt)}%" if math.isfinite(v) else missing
