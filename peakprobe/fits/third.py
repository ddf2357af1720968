"""The three-way judgement of a fitted exponent against the 1/3 prediction.

An exponent with a 90% interval [lo, hi] is

* ``consistent`` when the interval contains 1/3 *and* lies inside the equivalence band
  (default [0.25, 0.42]): the data pin the exponent near 1/3;
* ``inconsistent`` when 1/3 lies outside the interval;
* ``inconclusive`` otherwise (e.g. an interval wider than the band, or no interval at all).

"1/3 lies in a wide interval" is therefore never "consistent". numpy-free, pure Python.
"""

from __future__ import annotations

import math

from ..config import check_band
from ..vocab import BAND, CONSISTENT, INCONCLUSIVE, INCONSISTENT, THIRD

__all__ = ["judge_third"]


def judge_third(lo: float | None, hi: float | None, band: tuple[float, float] = BAND) -> str:
    """``consistent``, ``inconsistent`` or ``inconclusive`` for the interval [lo, hi]."""
    b_lo, b_hi = check_band(band)
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        return INCONCLUSIVE
    if not (lo <= THIRD <= hi):
        return INCONSISTENT
    if b_lo <= lo and hi <= b_hi:
        return CONSISTENT
    return INCONCLUSIVE
