"""Published learning-rate schedules of the OLMo-1, OLMo-2 and LLM360 Amber runs, in steps.

Each value is copied from the run's released training configuration (the sources are cited in
docs/checkpoints.md, one per entry); schedules given in tokens are converted with the run's
tokens per optimizer step (global batch x sequence length). Repos whose configuration we have
not read are absent: their tau stays unknown rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import Schedule, WarmupCosine, WarmupLinear


@dataclass(frozen=True)
class PublishedRun:
    """A run's schedule (in optimizer steps, or Amber checkpoint chunks) and where it is from."""

    schedule: Schedule
    tokens_per_step: int
    source: str


_OLMO2_7B_TOKENS = 1024 * 4096  # global_train_batch_size x max_sequence_length
_OLMO2_13B_TOKENS = 2048 * 4096
_OLMO1_TOKENS = 2048 * 2048

#: OLMo-2 stage 1: cosine_with_warmup in tokens, t_warmup 8,388,608,000, t_max 5e12, alpha_f 0.1,
#: warmup_min_lr 0, learning_rate 3e-4.
OLMO2_7B = PublishedRun(
    WarmupCosine(3e-4, 8_388_608_000 / _OLMO2_7B_TOKENS, 5e12 / _OLMO2_7B_TOKENS, 0.1),
    _OLMO2_7B_TOKENS,
    "allenai/OLMo configs/official-1124/OLMo2-7B-stage1.yaml",
)
OLMO2_13B = PublishedRun(
    WarmupCosine(3e-4, 8_388_608_000 / _OLMO2_13B_TOKENS, 5e12 / _OLMO2_13B_TOKENS, 0.1),
    _OLMO2_13B_TOKENS,
    "allenai/OLMo configs/official-1124/OLMo2-13B-stage1.yaml",
)
#: OLMo-1 1B: cosine_with_warmup, t_warmup 2000 steps, alpha_f 0.1, lr 4e-4, 739,328 steps.
OLMO1_1B = PublishedRun(
    WarmupCosine(4e-4, 2000, 739_328, 0.1), _OLMO1_TOKENS, "allenai/OLMo configs/official/OLMo-1B.yaml"
)
#: OLMo-1 7B: linear_with_warmup, t_warmup 5000 steps, alpha_f 0.1, lr 3e-4, max_duration 2e12 tokens.
OLMO1_7B = PublishedRun(
    WarmupLinear(3e-4, 5000, 2e12 / _OLMO1_TOKENS, 0.1), _OLMO1_TOKENS, "allenai/OLMo configs/official/OLMo-7B.yaml"
)

#: Amber: 360 data chunks of 1,706,976 examples (2,048 input tokens each); the lr schedule runs on
#: micro-batch steps: 1,706,976 // 560 = 3,048 per chunk (20 nodes x 4 GPUs x 7), warmup 2,000
#: optimizer steps x 4 accumulation = 8,000 micro-steps, cosine from 3e-4 to 3e-5 over all 360
#: chunks. In chunk units (checkpoint ckpt_k is saved after chunk k, i.e. at k + 1 chunks):
AMBER_CHUNK_TOKENS = 1_706_976 * 2048
AMBER = PublishedRun(
    WarmupCosine(3e-4, 8000 / 3048, 360, 0.1),
    AMBER_CHUNK_TOKENS,
    "LLM360/amber-train main.py (LEARNING_RATE, END_LEARNING_RATE, WARMUP_GRAD_STEPS, "
    "TRAIN_EXAMPLES_PER_CHUNK, N_CHUNKS), main_utils.py get_cosine_lr_decay_fn, run.sh (20 nodes)",
)

_BY_REPO = {
    "allenai/olmo-2-1124-7b": OLMO2_7B,
    "allenai/olmo-2-1124-13b": OLMO2_13B,
    "allenai/olmo-1b": OLMO1_1B,
    "allenai/olmo-1b-hf": OLMO1_1B,
    "allenai/olmo-7b": OLMO1_7B,
    "allenai/olmo-7b-hf": OLMO1_7B,
    "llm360/amber": AMBER,
}


def published_run(repo_id: str) -> PublishedRun | None:
    """The published schedule of ``repo_id`` (case-insensitive), or None when it is not built in."""
    return _BY_REPO.get(repo_id.strip().lower())
