"""Live probing during training: a framework-free :class:`Monitor`, an HF Trainer callback,
and ``attach_sdpa`` for any PyTorch model whose attention calls F.scaled_dot_product_attention.

The Monitor and the callback write the run directory a sweep writes (``checkpoints/step<N>.parquet`` + manifest), so
``peakprobe fit`` / ``peakprobe report`` work on a run still in progress (docs/monitor.md).
``PeakprobeCallback`` is imported on first use, so the Monitor does not load the Trainer.
"""

from __future__ import annotations

from ..hooks.sdpa import attach_sdpa
from .monitor import (
    Monitor,
    MonitorError,
    attribution_steps,
    live_config,
    planned_steps,
    training_state_preserved,
)
from .scalars import alarms, live_scalars

__all__ = [
    "Monitor",
    "MonitorError",
    "PeakprobeCallback",
    "alarms",
    "attribution_steps",
    "live_config",
    "planned_steps",
    "live_scalars",
    "attach_sdpa",
    "training_state_preserved",
]


def __getattr__(name: str):
    if name == "PeakprobeCallback":
        from .trainer import PeakprobeCallback

        return PeakprobeCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
