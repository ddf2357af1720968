"""Toy models: the peaked-softmax teacher-student head, the solvable linear attention, and the tiny LM.

* ``peakprobe.toy.peaked_softmax`` — the teacher-student linear softmax head (the 1/3 law).
* ``peakprobe.toy.linear_attention`` — the solvable linear self-attention (the contrast case).
* ``peakprobe.toy.tiny_lm`` — the tiny GPT-NeoX trainer behind ``peakprobe demo``.

The names below are loaded on first use, so importing this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

from peakprobe.vocab import PeakprobeError


class ToyConfigError(PeakprobeError):
    """A toy run asked for impossible settings (one-line message for the command line)."""


_EXPORTS = {
    "TinyLMConfig": "tiny_lm",
    "TinyLMError": "tiny_lm",
    "train_tiny_lm": "tiny_lm",
}
_SUBMODULES = ("tiny_lm", "peaked_softmax", "linear_attention")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
