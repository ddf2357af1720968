"""The solvable linear self-attention toy: a softmax-free contrast case whose exponents the data
spectrum sets (docs/linear_attention.md).

Modules, down the flow: ``config`` (the shared setting), ``theory`` (reduced dynamics, closed
forms), ``sim`` (training primitives), ``laws`` (records, verdicts, compute frontier),
``sweep`` (size sweep: time, model size, compute), ``data`` and ``context`` (their laws'
experiments), ``plots`` (figures), ``run`` (``reproduce_linear`` and ``format_linear``).

The names below are loaded on first use, so importing this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT": "config",
    "LAWS": "laws",
    "LinearAttentionConfig": "config",
    "reproduce_linear": "run",
    "compare": "sweep",
    "format_linear": "run",
    "reduced_dynamics": "theory",
    "simulate_linear_attention": "sweep",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
