"""The optional extras some tests need, and the one way those tests skip without them.

A test that cannot run without an extra skips with ``missing(extra, why)``. With
``PEAKPROBE_REQUIRE=triton,olmo_core,chromium`` (what CI sets once it has installed them) such a
skip fails instead: conftest.py turns it into a failure, so an extra CI installed cannot go
untested unnoticed.
"""

from __future__ import annotations

import os
import re

EXTRAS = ("triton", "olmo_core", "chromium")
_REASON = re.compile(r"missing extra (\w+):")


def missing(extra: str, why: str) -> str:
    """The skip reason for a test that needs ``extra`` (one of EXTRAS)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    return f"missing extra {extra}: {why}"


def required() -> set[str]:
    """The extras PEAKPROBE_REQUIRE names; an unknown name is an error, not a silent no-op."""
    names = {n.strip() for n in os.environ.get("PEAKPROBE_REQUIRE", "").split(",") if n.strip()}
    unknown = names - set(EXTRAS)
    if unknown:
        raise ValueError(f"PEAKPROBE_REQUIRE names unknown extras {sorted(unknown)}; known: {EXTRAS}")
    return names


def required_extra_of(reason: str) -> str | None:
    """The required extra a skip reason says is missing, or None."""
    match = _REASON.search(reason)
    return match.group(1) if match and match.group(1) in required() else None
