"""The run configuration records: which evaluation windows (``DataConfig``), what the probes
measure (``ProbeConfig``), whether and how the loss is attributed to each softmax
(``AttributionConfig``), how checkpoints are loaded and run (``SweepConfig``, which holds the
probe and attribution records), and how a run is fitted (``FitConfig``).

Plain, torch-free dataclasses. Each field is the one source of its default, its type and its
help text: the command line builds its options from these fields (``peakprobe.cli.options``;
a field's ``metadata`` holds its help and, where it differs from ``--field-name``, its flag),
and the Python API takes its defaults from the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .vocab import BAND, HEAD_GAIN_FLOOR, LAYOUTS, THIRD, PeakprobeError

#: the weight dtypes a sweep can load (``auto``: the checkpoint's own)
WEIGHT_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")
#: the precisions the statistics can be computed in
STATS_DTYPES: tuple[str, ...] = ("float32", "float64")
#: how single heads' optimal-temperature gains are found
HEAD_GAIN_MODES: tuple[str, ...] = ("screen", "estimate", "search", "off")
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
TIME_AXES: tuple[str, ...] = ("auto", "tau", "step")


class ConfigError(PeakprobeError):
    """An option out of range (one line for the command line)."""


def option(default: Any = None, help: str = "", *, flag: str | None = None,
           choices: tuple | None = None, metavar: str | None = None, cli: bool = True) -> Any:
    """A record field with its command-line face: ``help`` (``%(default)s`` is filled in by
    argparse), ``flag`` (default ``--field-name``; a ``--no-...`` flag turns a default-True bool
    off), ``choices``, ``metavar``; ``cli=False`` keeps the field off the command line."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "metavar": metavar, "cli": cli})


def check_band(band) -> tuple[float, float]:
    """The equivalence band as two floats lo < 1/3 < hi; a one-line ``ConfigError`` otherwise."""
    try:
        lo, hi = (float(band[0]), float(band[1]))
    except (TypeError, ValueError, IndexError):
        raise ConfigError(f"the band must be two numbers LO,HI around 1/3 (e.g. 0.25,0.42), got {band!r}") from None
    if not (lo < THIRD < hi):
        raise ConfigError(f"the band [{lo:g}, {hi:g}] must contain 1/3 strictly inside (e.g. 0.25,0.42)")
    return lo, hi


def parse_band(text: str) -> tuple[float, float]:
    """``"LO,HI"`` -> the checked band (the one parser of ``--band``)."""
    parts = str(text).split(",")
    if len(parts) != 2:
        raise ConfigError(f"the band must be LO,HI (e.g. 0.25,0.42), got {text!r}")
    try:
        values = (float(parts[0]), float(parts[1]))
    except ValueError:
        raise ConfigError(f"the band must be two numbers LO,HI (e.g. 0.25,0.42), got {text!r}") from None
    return check_band(values)


@dataclass
class DataConfig:
    """The evaluation windows: the same tokens for every checkpoint (``peakprobe.data``)."""

    data: str = option("embedded", "'embedded' (the demo's generated corpus), a .txt/.jsonl file, "
                       "or hf:NAME[:CONFIG]:SPLIT (default %(default)s)")
    n_windows: int = option(64, "evaluation windows (default %(default)s)")
    window: int | None = option(None, "tokens per window (default 1024, clamped to the model's "
                                "maximum positions)")
    text_field: str = option("text", "JSONL / dataset text field (default %(default)s)")
    layout: str = option("document", "one document per window, right-padded (default, as the 1/3 "
                         "papers); documents packed into full windows, attending across their "
                         "boundaries (packed); or packed with each document seeing only itself "
                         "(packed-docs)", choices=LAYOUTS)
    tokenizer: str | None = option(None, "tokenizer folder (default: the checkpoint's own)")

    def __post_init__(self) -> None:
        if self.n_windows < 1:
            raise ConfigError(f"--n-windows must be >= 1, got {self.n_windows}")
        if self.window is not None and self.window < 2:
            raise ConfigError(f"--window must be >= 2 tokens, got {self.window}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")


@dataclass
class ProbeConfig:
    """What the probes measure and how.

    chunk: query rows per block of attention logits on the torch path (memory is O(chunk x T)
        per head); None: 32 on CPU (the fastest there), and on a GPU as many as keep one block of
        logits within ``hooks.engine.GPU_BLOCK_ELEMENTS``.
    dtype: precision of the logits and statistics on the torch path ("float32", or "float64"
        for exact checks; the Triton kernel computes in float32).
    backend: "auto" (the fused Triton kernel on CUDA when triton is installed, the torch path
        elsewhere), "torch" (the exact reference), "triton" (the kernel; on CPU only under
        TRITON_INTERPRET=1).
    lm_chunk: token positions per block of LM-head logits.
    fused: compute each attention output from the probe's own scores (QK^T once; outputs within
        float rounding of eager attention, not bit-identical). Off by default: the model's own
        attention function then runs unchanged.
    """

    chunk: int | None = option(None, "query rows per logits block on the torch path (default: 32 "
                               "on CPU, the fastest there; on a GPU sized to a block of 2^25 logits)")
    dtype: str = option("float32", "precision of the statistics on the torch path (default "
                        "%(default)s)", flag="--stats-dtype", choices=STATS_DTYPES)
    backend: str = option("auto", "statistics path: auto (default: the fused Triton kernel on "
                          "CUDA, the torch path on CPU), torch (the exact reference) or triton",
                          choices=BACKENDS)
    lm_chunk: int = option(512, "token positions per block of LM-head logits (default %(default)s)")
    fused: bool = option(False, "compute attention outputs from the probe's own scores (QK^T once; "
                         "outputs within rounding of eager, not bit-identical)",
                         flag="--fused-attention")

    def __post_init__(self) -> None:
        if (self.chunk is not None and self.chunk < 1) or self.lm_chunk < 1:
            raise ConfigError(f"chunks must be >= 1, got {self.chunk} and {self.lm_chunk}")
        if self.dtype not in STATS_DTYPES:
            raise ConfigError(f"statistics dtype must be one of {', '.join(STATS_DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    def describe(self) -> dict:
        """The manifest's ``probe`` entry."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class AttributionConfig:
    """Whether and how a sweep attributes the loss to each softmax (``peakprobe.attribution``):
    d loss / d log beta, curvature and the optimal-temperature gain per site, run when a model
    is probed over windows (``checkpoint.probe_model``); ``attach`` itself never does.

    enabled: run the attribution at all. windows: the first N evaluation windows it runs on
    (0 = off). heads: single heads' gains: "screen" (one loss evaluation a head, made on the
    first half of the windows first, and a search to about 2% for the heads whose gain may reach
    ``vocab.HEAD_GAIN_FLOOR`` of the loss), "search" (the 1-D search for every head, to xtol),
    "estimate" (the local quadratic estimate alone), "off" (sensitivity only).
    """

    enabled: bool = option(True, "skip the attribution (d loss / d log beta, curvature, "
                           "optimal-temperature gain per site); same as --attribution-windows 0",
                           flag="--no-attribution")
    windows: int = option(4, "run the attribution on the first N evaluation windows (default "
                          "%(default)s; 0 = off)", flag="--attribution-windows", metavar="N")
    heads: str = option("screen", "single heads' gains: screen (default: one loss evaluation a "
                        "head, and a search to 2%% where the gain may reach half of "
                        f"{HEAD_GAIN_FLOOR:g} of the loss), search (every head, to xtol), estimate "
                        "(the local quadratic estimate alone), off (sensitivity only)",
                        flag="--head-gains", choices=HEAD_GAIN_MODES)

    def __post_init__(self) -> None:
        if self.windows < 0:
            raise ConfigError(f"attribution windows must be >= 0, got {self.windows}")
        if self.heads not in HEAD_GAIN_MODES:
            raise ConfigError(f"attribution heads must be one of {', '.join(HEAD_GAIN_MODES)}, got "
                              f"{self.heads!r}")

    @property
    def active(self) -> bool:
        """Whether ``probe_model`` runs the attribution pass."""
        return self.enabled and self.windows > 0


@dataclass
class SweepConfig:
    """How checkpoints are loaded and run, with the probe and attribution settings.

    dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``float64`` or ``auto`` for
    the checkpoint's own). device: ``auto`` (the process's accelerator if any, else CPU),
    ``cpu`` or ``cuda[:i]``. device_map: ``auto`` spreads large checkpoints over the available
    devices (accelerate). allow_pickle: accept ``pytorch_model.bin`` weights (they can run code).
    local_files_only: read hub revisions from the HF cache only (offline, or hub unreachable).
    """

    batch_size: int = option(8, "windows per forward pass (default %(default)s)")
    dtype: str = option("float32", "weights dtype (default %(default)s)", choices=("auto", *WEIGHT_DTYPES))
    device: str = option("auto", "auto, cpu, cuda, cuda:1 ... (default %(default)s)")
    device_map: str | None = option(None, "'auto' to spread a large checkpoint over devices")
    allow_pickle: bool = option(False, "accept pickle (.bin) weights: they can run code when loaded")
    trust_remote_code: bool = option(False, "run the checkpoint's own modeling code")
    prefetch: bool = option(True, "do not load the next checkpoint ahead", flag="--no-prefetch")
    local_files_only: bool = option(False, cli=False)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; use one of auto, {', '.join(WEIGHT_DTYPES)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")


@dataclass
class FitConfig:
    """How a run (``fits.fit_run``) or an external curve (``fits.curve``) is fitted: the time
    axis, the window, the equivalence band of the verdicts and the bootstrap."""

    time_axis: str = option("auto", "tau when every checkpoint has one (default auto), or step",
                            choices=TIME_AXES)
    t_min: float | None = option(None, "window start in time-axis units (default: the family's "
                                 "start step, e.g. 512 for Pythia, else past warmup)")
    t_max: float | None = option(None, "window end in time-axis units (default: the last checkpoint)")
    t_min_step: int | None = option(None, "window start as a step (external curves: default 512)")
    t_max_step: int | None = option(None, "window end as a step (default: the last checkpoint)")
    band: tuple[float, float] = option(BAND, "equivalence band around 1/3 for the verdicts "
                                       "(default 0.25,0.42)", metavar="LO,HI")
    n_boot: int = option(1000, "bootstrap resamples (default %(default)s)")
    seed: int = option(0, "bootstrap seed (default %(default)s)")

    def __post_init__(self) -> None:
        self.band = check_band(self.band)
        if self.time_axis not in TIME_AXES:
            raise ConfigError(f"time axis must be one of {', '.join(TIME_AXES)}, got {self.time_axis!r}")
        if self.n_boot < 0:
            raise ConfigError(f"--n-boot must be >= 0, got {self.n_boot}")


@dataclass
class CurveConfig:
    """How an external loss curve is read (``fits.curve_io``); its fit takes a ``FitConfig``."""

    metric: str | None = option(None, "metric column or lm-eval metric (default: the one loss or perplexity)")
    task: str | None = option(None, "lm-eval task (default: the one task with a perplexity)")
    allow_metric: bool = option(False, "fit a metric that is not a loss or perplexity as given "
                                "(e.g. 1 - acc)")
    family: str | None = option(None, "Pythia size for tau and parameters, e.g. pythia-160m "
                                "(default: from each model's name)")
    schedule: str | None = option(None, "schedule.json giving the learning-rate schedule (tau)")
    scan: bool = option(True, "skip the window scan", flag="--no-scan")
