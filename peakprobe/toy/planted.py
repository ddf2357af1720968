"""Planted bottlenecks: tiny GPT-NeoX checkpoint sequences whose bottleneck softmax is known.

This module owns the tasks' data (``generate``), their Bayes losses, the planted config and the
training loop; the hand-built scored-copy model is ``planted_scale``'s, its trained variants
(``trained_qk``, ``blind_spot``, ``trained_lm_head``) and their oracle are ``planted_trained``'s.
The tasks, what each plants and what the verdict says on it: docs/planted.md.

``train_planted(out_dir, config)`` writes ``step<N>/`` checkpoints (save_pretrained plus the
word-level tokenizer), ``schedule.json``, ``train_log.json`` and, last, ``planted.json``.
``write_eval_jsonl(path, config)`` writes held-out sequences, one JSON line of ``seq_len``
space-separated words each (no eos token, so windows of ``seq_len`` are exactly the sequences).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from peakprobe.hf import quiet_transformers_progress
from peakprobe.results import read_json, write_json
from peakprobe.toy import planted_scale, planted_trained
from peakprobe.toy.planted_trained import LM_HEAD_TWIN_TASK, TRAINED_TASKS
from peakprobe.toy.tiny_lm import TinyLMConfig, model_config, run_updates, torch_threads
from peakprobe.vocab import (
    BOTTLENECK_ATTENTION,
    BOTTLENECK_LM_HEAD,
    PeakprobeError,
)

LM_HEAD_TASK = "lm_head"
ATTENTION_TASK = "attention"
LAG_COPY_TASK = "lag_copy"
TEACHER_TASK = "teacher_attention"
TASKS: tuple[str, ...] = (LM_HEAD_TASK, ATTENTION_TASK, LAG_COPY_TASK, TEACHER_TASK, *TRAINED_TASKS)
#: the scored-copy tasks: the data of ``attention`` and the hand-built model, or its trained variants
SCORED_TASKS: tuple[str, ...] = (ATTENTION_TASK, *TRAINED_TASKS)
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")
UNK = "<unk>"
MARKER = "planted.json"
TRAIN_LOG = "train_log.json"
EVAL_FILE = "eval.jsonl"
PLANTED_FORMAT = 3  # bump when a change here changes the trained weights
_EVAL_STREAM = 1_000_003  # the eval sequences' seed offset, disjoint from every training batch


class PlantedError(PeakprobeError):
    """A planted-task config or output folder that cannot be used."""


SCORED_TOKENS = 255  # attention: scores 2 sqrt(3) / 254 apart, a continuum up to theta ~ 73
LAG_COPY_TOKENS = 31  # <= head_dim: one head's value/output path can copy every token exactly
# teacher_attention: 63 tokens in 32-token windows, so a context holds about 25 distinct tokens
# and the teacher's choice depends on the context, not on the query token alone
TEACHER_TOKENS = 63
TEACHER_SEQ_LEN = 32
TEACHER_BETA = 30.0  # teacher logit std over the vocabulary, far above sqrt(2 ln 32) = 2.6


def _default_model(task: str = LM_HEAD_TASK) -> TinyLMConfig:
    """The tiny GPT-NeoX and schedule of each task (2 layers, 64 wide, rotary on 1/4 as Pythia)."""
    common = dict(n_layers=2, hidden=64, intermediate=256, rotary_pct=0.25, seq_len=64,
                  batch_size=16, warmup_steps=20, final_lr_ratio=0.1, weight_decay=0.0,
                  n_checkpoints=32)
    if task == ATTENTION_TASK:
        # the hand-built scored-copy model (planted_scale): 1 layer, 1 head, the MLP unused; plain
        # SGD on theta alone (gradient flow: the regime of the 1/3 law), at a rate that takes the
        # head's logit std from about 7 to 23 over the fit window: peaked (> sqrt(2 ln 64) = 2.9)
        # and still below the scores' spacing (2 sqrt(3) / 254: theta ~ 73)
        return replace(TinyLMConfig(n_heads=1, steps=800, lr_max=15.0, **common), n_layers=1,
                       hidden=planted_scale.hidden_size(SCORED_TOKENS), intermediate=4,
                       rotary_pct=planted_scale.rotary_pct(SCORED_TOKENS))
    if task in TRAINED_TASKS:
        # the scored-copy model at 127 tokens; its query and key maps (or the LM head's input
        # scale) train by plain SGD, unclipped, from a small start
        return replace(TinyLMConfig(n_heads=1, steps=800, lr_max=planted_trained.LR_MAX, grad_clip=1e6,
                                    **common), n_layers=1, intermediate=4, n_checkpoints=20,
                       hidden=planted_scale.hidden_size(planted_trained.TRAINED_TOKENS),
                       rotary_pct=planted_scale.rotary_pct(planted_trained.TRAINED_TOKENS))
    if task == LAG_COPY_TASK:
        return TinyLMConfig(n_heads=2, steps=800, lr_max=3e-3, **common)
    if task == TEACHER_TASK:
        # content-based attention: one layer, rotary on only 1/8 of the head so that the
        # query-key form can be (almost) position-free; one 64-wide head copies 63 tokens
        return replace(TinyLMConfig(n_heads=1, steps=800, lr_max=3e-3, **common),
                       n_layers=1, rotary_pct=0.125, seq_len=TEACHER_SEQ_LEN)
    # the successor chain is learned fast: a lower rate and a short run keep the loss above
    # float32 resolution (it decays exponentially once the map is learned)
    return TinyLMConfig(n_heads=4, steps=500, lr_max=1e-3, **common)


@dataclass(frozen=True)
class PlantedConfig:
    """One planted run: the task and its parameters, and the model/schedule (a TinyLMConfig)."""

    task: str = LM_HEAD_TASK
    n_tokens: int = 127
    lag: int = 4
    noise: float = 0.5
    task_seed: int = 0  # picks the successor permutation / the teacher's scores
    teacher_beta: float = TEACHER_BETA  # teacher_attention: the teacher's logit std over the vocabulary
    teacher_rank: int = 8  # teacher_attention: rank of the teacher's bilinear form
    optimizer: str = "adamw"  # "adamw" (betas, weight decay of the model config) or "sgd"
    momentum: float = 0.9  # sgd's momentum
    readout_lr: float = 0.0  # attention: the LM head's rate as a multiple of theta's (0: frozen)
    model: TinyLMConfig = field(default_factory=_default_model)

    @classmethod
    def for_task(cls, task: str) -> PlantedConfig:
        """The documented run of ``task`` (docs/planted.md)."""
        if task == ATTENTION_TASK:
            return cls(task=task, n_tokens=SCORED_TOKENS, optimizer="sgd", momentum=0.0,
                       model=_default_model(task))
        if task in TRAINED_TASKS:
            noise = planted_trained.LM_HEAD_TWIN_NOISE if task == LM_HEAD_TWIN_TASK else 0.5
            return cls(task=task, n_tokens=planted_trained.TRAINED_TOKENS, noise=noise,
                       optimizer="sgd", momentum=0.0, model=_default_model(task))
        if task == LAG_COPY_TASK:
            return cls(task=task, n_tokens=LAG_COPY_TOKENS, model=_default_model(task))
        if task == TEACHER_TASK:
            return cls(task=task, n_tokens=TEACHER_TOKENS, model=_default_model(task))
        return cls(task=task, model=_default_model(task))

    @classmethod
    def quick(cls, task: str = LM_HEAD_TASK) -> PlantedConfig:
        """A run for smoke tests: a few seconds, 10 checkpoints."""
        cfg = cls.for_task(task)
        return replace(cfg, model=replace(cfg.model, steps=60, n_checkpoints=10, warmup_steps=5))

    @property
    def seq_len(self) -> int:
        return self.model.seq_len

    def validate(self) -> None:
        """Raise PlantedError on a config that cannot train."""
        if self.task not in TASKS:
            raise PlantedError(f"unknown planted task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.n_tokens < 2:
            raise PlantedError(f"n_tokens must be >= 2, got {self.n_tokens}")
        if self.task == LM_HEAD_TASK and self.n_tokens <= self.seq_len:
            # shorter cycles would repeat inside a window and let attention copy the answer
            raise PlantedError(f"lm_head task: n_tokens ({self.n_tokens}) must exceed seq_len ({self.seq_len})")
        if self.task == LAG_COPY_TASK:
            if not 2 <= self.lag < self.seq_len:
                raise PlantedError(f"lag must be in [2, seq_len={self.seq_len}), got {self.lag}")
        if self.task != LM_HEAD_TASK and not 0 <= self.noise < 1:
            raise PlantedError(f"noise must be in [0, 1), got {self.noise}")
        if not self.readout_lr >= 0 or (self.readout_lr and self.task != ATTENTION_TASK):
            raise PlantedError(f"readout_lr must be >= 0, and set only for the {ATTENTION_TASK} task")
        if self.task in SCORED_TASKS:
            m = self.model
            if (m.n_layers, m.n_heads, m.hidden) != (1, 1, planted_scale.hidden_size(self.n_tokens)):
                raise PlantedError(f"the {self.task} task's model is built by hand: 1 layer, 1 head, "
                                   f"hidden {planted_scale.hidden_size(self.n_tokens)} for {self.n_tokens} tokens")
        if not 0 <= self.momentum < 1:
            raise PlantedError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.optimizer not in OPTIMIZERS:
            raise PlantedError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.task == TEACHER_TASK:
            if not self.teacher_beta > 0:
                raise PlantedError(f"teacher_beta must be > 0, got {self.teacher_beta}")
            if not 1 <= self.teacher_rank < self.n_tokens:
                raise PlantedError(f"teacher_rank must be in [1, n_tokens={self.n_tokens}), got {self.teacher_rank}")
        try:
            self.model.validate()
        except ValueError as err:
            raise PlantedError(str(err)) from None

    def config_hash(self) -> str:
        text = json.dumps({"planted_format": PLANTED_FORMAT, **asdict(self)}, sort_keys=True)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# -- the tasks -----------------------------------------------------------------------------------


def successor_map(n_tokens: int, seed: int) -> np.ndarray:
    """A random permutation ``f`` of ``range(n_tokens)`` that is one single cycle: (n,) int64."""
    order = np.random.default_rng([seed, 7]).permutation(n_tokens)
    succ = np.empty(n_tokens, dtype=np.int64)
    succ[order] = np.roll(order, -1)  # f(order[i]) = order[i + 1]
    return succ


def generate(config: PlantedConfig, n_seqs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n_seqs`` task sequences: token indices (N, T) in ``[0, n_tokens)`` and a bool (N, T)
    mask, True where the token is determined by the planted rule (successor of the previous
    token, a copy of the token ``lag`` back, or a copy drawn by the teacher's attention)."""
    n, t = config.n_tokens, config.seq_len
    if config.task == LM_HEAD_TASK:
        succ = successor_map(n, config.task_seed)
        x = np.empty((n_seqs, t), dtype=np.int64)  # (N, T)
        x[:, 0] = rng.integers(n, size=n_seqs)
        for j in range(1, t):
            x[:, j] = succ[x[:, j - 1]]
        ruled = np.ones((n_seqs, t), dtype=bool)
        ruled[:, 0] = False
        return x, ruled
    if config.task == TEACHER_TASK:
        return _generate_teacher(config, n_seqs, rng)
    if config.task in SCORED_TASKS:
        return _generate_scored(config, n_seqs, rng)
    x = rng.integers(n, size=(n_seqs, t))  # (N, T) fresh tokens
    ruled = rng.random((n_seqs, t)) >= config.noise  # (N, T)
    ruled[:, : config.lag] = False
    for j in range(config.lag, t):  # in order: the source may itself be a copy
        x[:, j] = np.where(ruled[:, j], x[:, j - config.lag], x[:, j])
    return x, ruled


def teacher_scores(config: PlantedConfig) -> np.ndarray:
    """The teacher's query-key scores S (n, n) float64: S[q, k] = e(q)^T A e(k) / sigma_q.

    e (n, r) are centred Gaussian token embeddings and A (r, r) a Gaussian bilinear form, so S
    has rank ``teacher_rank``; each row is divided by its std, so every query's scores over the
    vocabulary have mean 0 and std 1 and ``teacher_beta * S`` has logit std ``teacher_beta``.
    """
    rng = np.random.default_rng([config.task_seed, 11])
    e = rng.standard_normal((config.n_tokens, config.teacher_rank))  # (n, r)
    e -= e.mean(axis=0)
    a = rng.standard_normal((config.teacher_rank, config.teacher_rank))  # (r, r)
    s = e @ a @ e.T  # (n, n), rows sum to 0 since e is centred
    return s / s.std(axis=1, keepdims=True)


def teacher_attention(config: PlantedConfig, context: np.ndarray) -> np.ndarray:
    """The teacher's attention of the last position over the context: (N, t) float64 rows
    summing to 1, softmax over keys s of ``teacher_beta * S[x_last, x_s]``."""
    scores = teacher_scores(config)
    z = config.teacher_beta * scores[context[:, -1:], context]  # (N, t)
    z -= z.max(axis=1, keepdims=True)
    w = np.exp(z)
    return w / w.sum(axis=1, keepdims=True)


def next_token_distribution(config: PlantedConfig, context: np.ndarray) -> np.ndarray:
    """teacher_attention: the Bayes next-token distribution after ``context`` (N, t), (N, n):
    ``noise / n + (1 - noise) * sum_s w_s [x_s = y]``."""
    w = teacher_attention(config, context)  # (N, t)
    copy = np.zeros((context.shape[0], config.n_tokens))  # (N, n)
    np.add.at(copy, (np.arange(context.shape[0])[:, None], context), w)
    return config.noise / config.n_tokens + (1 - config.noise) * copy


def sample_next(config: PlantedConfig, context: np.ndarray,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """teacher_attention: one next token (N,) after each context (N, t) and whether it was
    copied (N,) bool: with probability 1 - noise the token at a position drawn from the
    teacher's attention (Gumbel-max), else a uniform token."""
    n_seqs, t = context.shape
    z = config.teacher_beta * teacher_scores(config)[context[:, -1:], context]  # (N, t)
    source = (z + rng.gumbel(size=(n_seqs, t))).argmax(axis=1)  # (N,) position s ~ w
    copied = context[np.arange(n_seqs), source]
    fresh = rng.integers(config.n_tokens, size=n_seqs)
    copy = rng.random(n_seqs) >= config.noise
    return np.where(copy, copied, fresh), copy


def _generate_teacher(config: PlantedConfig, n_seqs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """teacher_attention sequences: (N, T) tokens and the (N, T) mask of copied tokens."""
    x = np.empty((n_seqs, config.seq_len), dtype=np.int64)  # (N, T)
    ruled = np.zeros((n_seqs, config.seq_len), dtype=bool)  # (N, T)
    x[:, 0] = rng.integers(config.n_tokens, size=n_seqs)
    for j in range(1, config.seq_len):
        x[:, j], ruled[:, j] = sample_next(config, x[:, :j], rng)
    return x, ruled


def _generate_scored(config: PlantedConfig, n_seqs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """attention (scored copy) sequences: (N, T) tokens and the (N, T) mask of copied tokens."""
    score = planted_scale.token_scores(config.n_tokens, config.task_seed)
    f = planted_scale.copy_map(config.n_tokens, config.task_seed)
    x = rng.integers(config.n_tokens, size=(n_seqs, config.seq_len))  # (N, T) fresh tokens
    ruled = rng.random((n_seqs, config.seq_len)) >= config.noise  # (N, T)
    ruled[:, 0] = False
    best = x[:, 0].copy()  # (N,) the highest-scoring token so far
    for j in range(1, config.seq_len):  # in order: a copy enters the context it is scored in
        x[:, j] = np.where(ruled[:, j], f[best], x[:, j])
        best = np.where(score[x[:, j]] > score[best], x[:, j], best)
    return x, ruled


def words(config: PlantedConfig) -> list[str]:
    """The task tokens' words, ``w0 .. w{n-1}``; token index ``i`` has tokenizer id ``i + 1``."""
    return [f"w{i}" for i in range(config.n_tokens)]


def build_tokenizer(config: PlantedConfig, model_max_length: int = 2048):
    """A word-level tokenizer over ``<unk>`` + the task words, with no bos/eos/pad tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {UNK: 0, **{w: i + 1 for i, w in enumerate(words(config))}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, model_max_length=model_max_length)


def eval_sequences(config: PlantedConfig, n_seqs: int) -> np.ndarray:
    """The held-out evaluation sequences (token indices, (N, T)); the same for every call."""
    x, _ = generate(config, n_seqs, np.random.default_rng([config.model.seed, _EVAL_STREAM]))
    return x


def write_eval_jsonl(path: str | os.PathLike, config: PlantedConfig, n_seqs: int = 64) -> Path:
    """Write ``n_seqs`` held-out sequences as JSON lines ``{"text": "w3 w17 ..."}``."""
    vocab = words(config)
    path = Path(path)
    lines = [json.dumps({"text": " ".join(vocab[i] for i in row)}) for row in eval_sequences(config, n_seqs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def bayes_loss(config: PlantedConfig) -> float:
    """The lowest achievable mean next-token loss (nats) over the T - 1 predicted positions."""
    n, t = config.n_tokens, config.seq_len
    if config.task == LM_HEAD_TASK:
        return 0.0
    if config.task == TEACHER_TASK:  # Monte Carlo over fixed sequences (no closed form)
        x, _ = generate(config, 512, np.random.default_rng([config.task_seed, 13]))
        nll = [-np.log(next_token_distribution(config, x[:, : j + 1])[np.arange(len(x)), x[:, j + 1]])
               for j in range(t - 1)]
        return float(np.mean(nll))
    hit = 1 - config.noise + config.noise / n
    mixed = -(hit * np.log(hit) + (n - 1) * (config.noise / n) * np.log(config.noise / n))
    if config.task in SCORED_TASKS:  # every target has its source: x[0] is already scored
        return float(mixed)
    unpredictable = config.lag - 1  # targets x[1 .. lag-1] have no source in the window
    return float((unpredictable * np.log(n) + (t - 1 - unpredictable) * mixed) / (t - 1))


# -- training ------------------------------------------------------------------------------------


def is_complete(out_dir: str | os.PathLike, config: PlantedConfig) -> bool:
    """True when ``out_dir`` holds a finished run of exactly ``config``."""
    out = Path(out_dir)
    try:
        record = read_json(out / MARKER)
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("config_hash") != config.config_hash():
        return False
    return all((out / f"step{s}" / "model.safetensors").exists() for s in config.model.checkpoint_steps())


def train_planted(
    out_dir: str | os.PathLike,
    config: PlantedConfig | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
    threads: int | None = 1,
) -> Path:
    """Train (or reuse) a planted run in ``out_dir``; return ``out_dir`` as a Path.

    A finished run of the same config is reused; one of another config raises PlantedError
    unless ``overwrite``. ``threads`` sets torch's intra-op threads for the training (None keeps
    torch's default); the training is seeded and runs on CPU, so it is deterministic.
    """

    config = config or PlantedConfig()
    config.validate()
    out = Path(out_dir)
    if is_complete(out, config):
        return out
    if out.exists() and not out.is_dir():
        raise PlantedError(f"{out} exists and is not a folder; choose another output folder")
    if (out / MARKER).exists() and not overwrite:
        raise PlantedError(f"{out} holds a planted run with a different config; use another folder or overwrite")
    if threads is not None and threads < 1:
        raise PlantedError(f"threads must be >= 1, got {threads}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    with torch_threads(threads):
        _train(out, config, progress)
    return out


def _train(out: Path, config: PlantedConfig, progress: bool) -> None:
    """Run the training loop with transformers' own saving progress bars off (ours shows the work)."""
    with quiet_transformers_progress():
        _train_loop(out, config, progress)


def _train_loop(out: Path, config: PlantedConfig, progress: bool) -> None:
    """The training loop: a fresh seeded batch per update, Adam, warmup + cosine, log-spaced saves."""
    import torch
    from transformers import GPTNeoXForCausalLM

    started = time.perf_counter()
    cfg = config.model
    tokenizer = build_tokenizer(config, model_max_length=max(2048, cfg.seq_len))
    if config.task in SCORED_TASKS:  # built by hand: theta, or the trained variant's maps, train
        model = planted_scale.build_model(config, tokenizer)
        calib, _ = generate(config, 256, np.random.default_rng([config.task_seed, 23]))
        planted_scale.calibrate_readout(model, torch.from_numpy(calib + 1))
        if config.task in TRAINED_TASKS:
            groups = planted_trained.prepare(model, config.task, cfg.seed)
        else:
            groups = planted_scale.train_only_theta(model, readout=config.readout_lr > 0)
        if len(groups) > 1:
            groups[1]["lr_scale"] = config.readout_lr
    else:
        torch.manual_seed(cfg.seed)
        model = GPTNeoXForCausalLM(model_config(cfg, tokenizer))
        groups = [{"params": list(model.parameters())}]
    model.set_attn_implementation("sdpa")
    model.train()
    if config.optimizer == "sgd":  # gradient-proportional steps: the regime of the 1/3 law
        optimizer = torch.optim.SGD(groups, lr=cfg.lr_max, momentum=config.momentum,
                                    weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr_max, betas=cfg.betas, eps=1e-8,
                                      weight_decay=cfg.weight_decay)
    save_steps = set(cfg.checkpoint_steps())

    def batch(step: int):  # a fresh seeded batch per update: (B, T) tokenizer ids
        x, _ = generate(config, cfg.batch_size, np.random.default_rng([cfg.seed, step]))
        return torch.from_numpy(x + 1)

    losses, lrs = run_updates(model, optimizer, tokenizer, out, cfg, batch,
                              desc=f"planted {config.task}", progress=progress)
    write_json(out / TRAIN_LOG, {
        "format": 1, "step": list(range(1, cfg.steps + 1)), "loss": losses, "lr": lrs,
        "seconds": time.perf_counter() - started, "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "bayes_loss": bayes_loss(config),
    })
    write_json(out / MARKER, {
        "format": 1, "config": asdict(config), "config_hash": config.config_hash(),
        "checkpoint_steps": sorted(save_steps), "planted_site": planted_site(config),
        "torch": torch.__version__,
    })


def planted_site(config: PlantedConfig) -> str:
    """The softmax kind that is the bottleneck by construction: ``lm_head`` or ``attention``."""
    return BOTTLENECK_LM_HEAD if config.task in (LM_HEAD_TASK, LM_HEAD_TWIN_TASK) else BOTTLENECK_ATTENTION
