"""Built-in checkpoint families that need no network: Pythia (every size, -deduped, and the
PolyPythias ``pythia-<size>-seed<N>``, which share Pythia's revisions and schedule).

Pythia facts (docs/science.md): revisions ``step0, step1, step2, step4, ..., step512`` then
``step1000 ... step143000`` every 1000 (154 in all; ``main`` = step143000); 1024 x 2048 =
2,097,152 tokens per step; linear warmup over 1% of 143,000 steps (1,430), cosine decay to
0.1 lr_max at step 143,000; lr_max and layer / hidden / head counts per size below.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import UnknownFamilyError
from .records import Checkpoint, CheckpointSequence
from .schedules import WarmupCosine

PYTHIA_TOKENS_PER_STEP = 1024 * 2048
PYTHIA_TOTAL_STEPS = 143_000
PYTHIA_WARMUP_STEPS = PYTHIA_TOTAL_STEPS // 100
PYTHIA_FINAL_LR_RATIO = 0.1
PYTHIA_STEPS: tuple[int, ...] = (
    (0,) + tuple(2**i for i in range(10)) + tuple(range(1000, PYTHIA_TOTAL_STEPS + 1, 1000))
)
#: the checkpoints the 1/3-law authors probed for their Pythia fits
PYTHIA_AUTHOR_STEPS: tuple[int, ...] = (
    128, 256, 512, 1000, 2000, 3000, 6000, 12000, 16000, 32000, 48000, 79000, 143000,
)
#: how many checkpoints the default Pythia selection holds (authors' steps + log-spaced fill)
PYTHIA_DEFAULT_COUNT = 16
#: default first step of the fit window (the authors' windows: 256 for 70m, 512 otherwise)
PYTHIA_FIT_START = 512
PYTHIA_FIT_START_SMALL = 256


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape of one model size."""

    n_layers: int
    hidden_size: int
    n_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads


PYTHIA_SHAPES: dict[str, ModelShape] = {
    "14m": ModelShape(6, 128, 4),
    "31m": ModelShape(6, 256, 8),
    "70m": ModelShape(6, 512, 8),
    "160m": ModelShape(12, 768, 12),
    "410m": ModelShape(24, 1024, 16),
    "1b": ModelShape(16, 2048, 8),
    "1.4b": ModelShape(24, 2048, 16),
    "2.8b": ModelShape(32, 2560, 32),
    "6.9b": ModelShape(32, 4096, 32),
    "12b": ModelShape(36, 5120, 40),
}
#: padded vocabulary of every Pythia size (untied input and output embeddings)
PYTHIA_VOCAB = 50304


def pythia_parameters(size: str) -> int:
    """Total parameters of Pythia ``size`` (embeddings included), from its shape:
    12 d^2 + 13 d per GPT-NeoX layer, two untied V x d embeddings, a final layer norm."""
    s = PYTHIA_SHAPES[size]
    d = s.hidden_size
    return s.n_layers * (12 * d * d + 13 * d) + 2 * PYTHIA_VOCAB * d + 2 * d


PYTHIA_LR_MAX: dict[str, float] = {
    "14m": 1e-3,
    "31m": 1e-3,
    "70m": 1e-3,
    "160m": 6e-4,
    "410m": 3e-4,
    "1b": 2.5e-4,
    "1.4b": 2e-4,
    "2.8b": 1.6e-4,
    "6.9b": 1.2e-4,
    "12b": 1.2e-4,
}
PYTHIA_SIZES: tuple[str, ...] = tuple(PYTHIA_SHAPES)
PYTHIA_DEDUPED_SIZES: tuple[str, ...] = PYTHIA_SIZES[2:]  # 70m .. 12b

PYTHIA_NAMES: tuple[str, ...] = tuple(f"pythia-{s}" for s in PYTHIA_SIZES) + tuple(
    f"pythia-{s}-deduped" for s in PYTHIA_DEDUPED_SIZES
)
_PYTHIA_ID_RE = re.compile(
    r"(?:eleutherai/)?pythia-(?P<size>[0-9.]+[mb])(?P<deduped>-deduped)?(?:-seed(?P<seed>\d+))?",
    re.I,
)

BUILTIN_FAMILIES_TEXT = (
    "built-in pythia-<size>[-deduped][-seed<N>] with size in "
    + ", ".join(PYTHIA_SIZES)
    + " (-deduped from 70m)"
)
LOCAL_FOLDER_TEXT = (
    "a local folder of step<N>/, checkpoint-<N>/ or <name>-step<N>/ save_pretrained subfolders"
)
KNOWN_FAMILIES_TEXT = (
    f"{BUILTIN_FAMILIES_TEXT}; hub ids (online) whose branches follow Pythia step<N>, "
    "OLMo-1 step<N>-tokens<X>B, OLMo-2 stage1-step<N>-tokens<X>B or LLM360 Amber ckpt_NNN; "
    f"or {LOCAL_FOLDER_TEXT}"
)


def pythia_schedule(size: str) -> WarmupCosine:
    """The learning-rate schedule Pythia ``size`` was trained with."""
    _check_size(size, deduped=False)
    return WarmupCosine(
        lr_max=PYTHIA_LR_MAX[size],
        warmup_steps=PYTHIA_WARMUP_STEPS,
        total_steps=PYTHIA_TOTAL_STEPS,
        final_lr_ratio=PYTHIA_FINAL_LR_RATIO,
    )


def _check_size(size: str, deduped: bool) -> None:
    if size not in PYTHIA_SHAPES:
        raise UnknownFamilyError(
            f"unknown Pythia size {size!r}; known sizes: {', '.join(PYTHIA_SIZES)}"
        )
    if deduped and size not in PYTHIA_DEDUPED_SIZES:
        raise UnknownFamilyError(
            f"pythia-{size} has no -deduped variant; deduped sizes: {', '.join(PYTHIA_DEDUPED_SIZES)}"
        )


def pythia(
    size: str,
    deduped: bool = False,
    steps: tuple[int, ...] | None = None,
    seed: int | None = None,
) -> CheckpointSequence:
    """The Pythia checkpoint sequence of one size: 154 revisions, tokens and tau per step.

    ``steps`` restricts the sequence to those steps (used when a hub listing or the local cache
    has fewer branches); by default all 154 published revisions are listed. ``seed`` names a
    PolyPythia re-run (``pythia-160m-seed3``), same revisions and schedule.
    """
    size = size.lower()
    _check_size(size, deduped)
    schedule = pythia_schedule(size)
    name = f"pythia-{size}" + ("-deduped" if deduped else "") + (f"-seed{seed}" if seed is not None else "")
    use = PYTHIA_STEPS if steps is None else tuple(sorted(set(steps)))
    checkpoints = [
        Checkpoint(
            revision=f"step{s}",
            step=s,
            tokens=s * PYTHIA_TOKENS_PER_STEP,
            tau=float(schedule.tau(s)),
        )
        for s in use
    ]
    return CheckpointSequence(
        name=name,
        source=f"EleutherAI/{name}",
        checkpoints=checkpoints,
        schedule=schedule,
        family="pythia",
        fit_start_step=PYTHIA_FIT_START_SMALL if size == "70m" else PYTHIA_FIT_START,
    )


def pythia_default_steps(available: list[int] | tuple[int, ...], n: int = PYTHIA_DEFAULT_COUNT) -> list[int]:
    """The default Pythia selection among ``available`` steps: the authors' 13 steps, then steps
    log-spaced in (1 + step) filling the widest gaps until there are ``n`` (or all available)."""
    pool = sorted(set(int(s) for s in available))
    picked = [s for s in PYTHIA_AUTHOR_STEPS if s in pool]
    rest = [s for s in pool if s not in picked and s > 0]
    while len(picked) < n and rest:
        axis = sorted(math.log1p(s) for s in picked) or [0.0]
        # the candidate farthest (in log1p) from every step picked so far
        best = max(rest, key=lambda s: (min(abs(math.log1p(s) - a) for a in axis), -s))
        picked.append(best)
        rest.remove(best)
    return sorted(picked)


def match_pythia(spec: str) -> tuple[str, bool, int | None] | None:
    """``(size, deduped, seed)`` when ``spec`` names Pythia (``pythia-70m``,
    ``EleutherAI/pythia-160m-deduped``, PolyPythia ``pythia-410m-seed3``; seed None otherwise).

    Returns None when ``spec`` is not Pythia-shaped; raises UnknownFamilyError for a Pythia-shaped
    name with an unknown size.
    """
    m = _PYTHIA_ID_RE.fullmatch(spec.strip())
    if m is None:
        return None
    size, deduped = m["size"].lower(), m["deduped"] is not None
    _check_size(size, deduped)
    return size, deduped, None if m["seed"] is None else int(m["seed"])


def pythia_size(name: str) -> str | None:
    """``70m`` for ``pythia-70m`` / ``EleutherAI/pythia-70m-deduped``; None for other names."""
    try:
        hit = match_pythia(name)
    except UnknownFamilyError:
        return None
    return hit[0] if hit else None
