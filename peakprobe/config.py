"""The run configuration records: what the probes measure (``ProbeConfig``) and how checkpoints
are loaded and run (``SweepConfig``).

Plain, torch-free dataclasses: their field defaults are the one source of defaults, read by the
command line (``peakprobe sweep --help`` shows them) as well as by the Python API, and importing
this module costs nothing. ``peakprobe.hooks`` and ``peakprobe.sweep`` re-export them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

#: the weight dtypes a sweep can load (``auto``: the checkpoint's own)
WEIGHT_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")
#: the precisions the statistics can be computed in
STATS_DTYPES: tuple[str, ...] = ("float32", "float64")
#: how single heads' optimal-temperature gains are found
HEAD_GAIN_MODES: tuple[str, ...] = ("screen", "estimate", "search", "off")
BACKENDS: tuple[str, ...] = ("auto", "torch", "compile", "triton")


class ConfigError(ValueError):
    """An option out of range (one line for the command line)."""


@dataclass
class ProbeConfig:
    """What to measure and how.

    chunk: query rows per block of attention logits (memory is O(chunk x T) per head); None:
        32 on CPU (the fastest there), and on a GPU as many as keep one block of logits within
        ``hooks.interface.GPU_BLOCK_ELEMENTS`` (few large kernels instead of many small ones).
    dtype: precision of the logits and statistics ("float32", or "float64" for exact checks).
    sensitivity: run the attribution (d loss / d log beta, curvature, optimal-temperature gain
        per site; ``peakprobe.hooks.attribution``) when a model is probed over windows
        (``sweep.probe_model``); ``attach`` itself never does.
    attribution_windows: the first N evaluation windows the attribution runs on (0 = off).
    attribution_heads: single heads' gains: "screen" (one loss evaluation a head, made on the
        first half of the windows first, and a search to about 2% for the heads whose gain may
        reach ``vocab.HEAD_GAIN_FLOOR`` of the loss),
        "search" (the 1-D search for every head, to xtol), "estimate" (the local quadratic
        estimate alone, one evaluation), "off" (sensitivity only).
    backend: "torch", "compile" (the torch path with each block's reductions fused by
        ``torch.compile``: fewer passes, a compile of tens of seconds on first use; on CPU it
        needs a C++ compiler), "triton" (the Triton kernel for the base metrics and the torch
        path for the rest; on CPU it needs TRITON_INTERPRET=1) or "auto" (the torch path: with
        the rest of the metrics to fill, the kernel adds its time to the torch path's; docs/gpu.md).
    lm_chunk: token positions per block of LM-head logits.
    fused: compute each attention output from the probe's own scores (QK^T once; outputs
        within float rounding of eager attention, not bit-identical to the model's own path).
        Off by default: the model's attention function then runs unchanged.
    """

    chunk: int | None = None
    dtype: str = "float32"
    sensitivity: bool = True
    backend: str = "auto"
    lm_chunk: int = 512
    attribution_windows: int = 4
    attribution_heads: str = "screen"
    fused: bool = False

    def __post_init__(self) -> None:
        if (self.chunk is not None and self.chunk < 1) or self.lm_chunk < 1:
            raise ConfigError(f"chunks must be >= 1, got {self.chunk} and {self.lm_chunk}")
        if self.dtype not in STATS_DTYPES:
            raise ConfigError(f"statistics dtype must be one of {', '.join(STATS_DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.attribution_windows < 0:
            raise ConfigError(f"attribution windows must be >= 0, got {self.attribution_windows}")
        if self.attribution_heads not in HEAD_GAIN_MODES:
            raise ConfigError(f"attribution heads must be one of {', '.join(HEAD_GAIN_MODES)}, got "
                              f"{self.attribution_heads!r}")

    @property
    def attribution(self) -> bool:
        """Whether ``probe_model`` runs the attribution pass."""
        return self.sensitivity and self.attribution_windows > 0

    def describe(self) -> dict:
        """The manifest's ``probe`` entry (the sweep adds the attribution method's description)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("attribution_")}
        d["attribution"] = (
            {"windows": self.attribution_windows, "heads": self.attribution_heads} if self.attribution else None
        )
        return d


@dataclass
class SweepConfig:
    """How checkpoints are loaded and run.

    dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``float64`` or ``auto`` for
    the checkpoint's own). device: ``auto`` (the process's accelerator if any, else CPU),
    ``cpu`` or ``cuda[:i]``. device_map: ``auto`` spreads large checkpoints over the available
    devices (accelerate). allow_pickle: accept ``pytorch_model.bin`` weights (they can run code).
    local_files_only: read hub revisions from the HF cache only (offline, or hub unreachable).
    """

    batch_size: int = 8
    dtype: str = "float32"
    device: str = "auto"
    device_map: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    prefetch: bool = True
    local_files_only: bool = False
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; use one of auto, {', '.join(WEIGHT_DTYPES)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")


def default(record: type, name: str):
    """The default of field ``name`` of the dataclass ``record`` (the CLI's defaults)."""
    for f in fields(record):
        if f.name == name:
            return f.default
    raise KeyError(name)
