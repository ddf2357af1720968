"""The tiny-LM trainer behind the demo: a small GPT-NeoX (Pythia architecture) on the embedded corpus.

``train_tiny_lm(out_dir, config)`` trains on CPU with a Pythia-like schedule (linear warmup, then
cosine decay to ``final_lr_ratio * lr_max``) and writes a local checkpoint sequence:

```
OUT/
  step0/ step1/ ... step<steps>/   # model.save_pretrained(safetensors) + the tokenizer
  schedule.json                    # {"kind": "warmup_cosine", ...} so tau is known
  train_log.json                   # loss and learning rate of every update
  tiny_lm.json                     # config + its hash; written last, marks the run complete
```

``on_step(step, model, optimizer, scheduler)``, if given, is called once before the first update
(step 0) and after every update (the demo passes a live Monitor's ``on_step`` here; this module
knows nothing about probing). ``scheduler`` is None: the loop sets each update's rate itself.

Each ``step<N>/`` folder is written under a temporary name and renamed when complete, so an
interrupted run never leaves a half-written folder under a final name. A second call with the
same config finds the marker and returns at once.

The update that takes the weights from step ``k-1`` to step ``k`` uses the schedule's mean rate
over ``[k-1, k]``, ``lr_max * (tau(k) - tau(k-1))``, so the sum of ``lr / lr_max`` over the first
``k`` updates equals the closed-form dynamic time ``tau(k) = integral_0^k lr(s) / lr_max ds`` that
``schedule.json`` describes (to float rounding): a live probe summing the rates and a sweep
reading ``schedule.json`` give the same tau.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peakprobe import corpus
from peakprobe.checkpoints_index.schedules import WarmupCosine
from peakprobe.hf import quiet_transformers_progress
from peakprobe.results import read_json, write_json
from peakprobe.vocab import PeakprobeError

MARKER = "tiny_lm.json"
SCHEDULE = "schedule.json"
TRAIN_LOG = "train_log.json"
TRAINER_FORMAT = 3  # bump when a change to this module or the corpus changes the trained weights


class TinyLMError(PeakprobeError):
    """A tiny-LM config or output folder the trainer cannot use."""


@dataclass(frozen=True)
class TinyLMConfig:
    """Architecture, data and schedule of one tiny-LM run (all of it enters the cache hash)."""

    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    intermediate: int = 512
    rotary_pct: float = 0.25
    seq_len: int = 256
    steps: int = 800
    batch_size: int = 8
    lr_max: float = 3e-3
    warmup_steps: int = 20
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    n_checkpoints: int = 16
    save_steps: tuple[int, ...] = field(default=())

    @classmethod
    def quick(cls) -> TinyLMConfig:
        """A run for tests: a few seconds on 2 cores, still 8 checkpoints."""
        return cls(
            n_layers=2, hidden=64, n_heads=4, intermediate=256, seq_len=64, steps=60,
            batch_size=8, warmup_steps=5, n_checkpoints=8,
        )

    def validate(self) -> None:
        """Raise TinyLMError on a config that cannot train."""
        if self.hidden % self.n_heads:
            raise TinyLMError(f"hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})")
        for name in ("n_layers", "hidden", "n_heads", "intermediate", "seq_len", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise TinyLMError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise TinyLMError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if not 0 < self.final_lr_ratio <= 1 or self.lr_max <= 0:
            raise TinyLMError("lr_max must be > 0 and final_lr_ratio in (0, 1]")
        if not self.save_steps and self.n_checkpoints < 2:
            raise TinyLMError(f"n_checkpoints must be >= 2, got {self.n_checkpoints}")
        bad = [s for s in self.save_steps if not 0 <= s <= self.steps]
        if bad:
            raise TinyLMError(f"save_steps {bad} are outside [0, steps={self.steps}]")

    def checkpoint_steps(self) -> list[int]:
        """Steps saved: ``save_steps`` if given, else step 0 plus ``n_checkpoints - 1`` log-spaced."""
        if self.save_steps:
            return sorted(set(self.save_steps))
        n = self.n_checkpoints - 1
        ratio = self.steps ** (1.0 / max(n - 1, 1))
        return sorted({0, *(min(self.steps, round(ratio**i)) for i in range(n)), self.steps})

    def schedule(self) -> dict:
        """The ``schedule.json`` record (docs/architecture.md)."""
        return {
            "kind": "warmup_cosine",
            "lr_max": self.lr_max,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.steps,
            "final_lr_ratio": self.final_lr_ratio,
        }

    def config_hash(self) -> str:
        payload = {"trainer_format": TRAINER_FORMAT, "vocab": len(corpus.VOCAB), **asdict(self)}
        text = json.dumps(payload, sort_keys=True)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def update_lr(step: int, config: TinyLMConfig) -> float:
    """The rate of update ``step`` (1-based): the schedule's mean over ``[step - 1, step]``."""
    schedule = WarmupCosine(config.lr_max, config.warmup_steps, config.steps, config.final_lr_ratio)
    return config.lr_max * (schedule.tau(step) - schedule.tau(step - 1))


def model_config(config: TinyLMConfig, tokenizer):
    """The ``transformers.GPTNeoXConfig`` of the run (Pythia layout, parallel residual, untied head)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        intermediate_size=config.intermediate,
        max_position_embeddings=max(2048, config.seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": config.rotary_pct},
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def training_tokens(config: TinyLMConfig, tokenizer):
    """The training windows, one fresh block per update: LongTensor (steps, batch, seq_len).

    Documents of the embedded corpus (seed ``config.seed``) are tokenized, joined with eos and
    cut into consecutive windows, so each update sees new text (a single epoch, as in Pythia).
    """
    import torch

    need = config.steps * config.batch_size * config.seq_len
    ids: list[int] = []
    start, chunk = 0, 256
    while len(ids) < need:
        docs = corpus.generate_documents(chunk, seed=config.seed, start=start)
        for doc_ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
            ids.extend(doc_ids)
            ids.append(tokenizer.eos_token_id)
        start += chunk
    flat = torch.tensor(ids[:need], dtype=torch.long)
    return flat.view(config.steps, config.batch_size, config.seq_len)  # (S, B, T)


def save_checkpoint(model, tokenizer, out_dir: Path, step: int) -> Path:
    """Write ``step<step>/`` atomically: save into a temporary folder, then rename it."""
    final = out_dir / f"step{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step{step}.", suffix=".tmp", dir=out_dir))
    try:
        with quiet_transformers_progress():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():  # left by an earlier, interrupted run of the same trainer
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def is_complete(out_dir: str | os.PathLike, config: TinyLMConfig) -> bool:
    """True when ``out_dir`` holds a finished run of exactly ``config``."""
    out = Path(out_dir)
    marker = out / MARKER
    if not marker.exists():
        return False
    try:
        record = read_json(marker)
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("config_hash") != config.config_hash():
        return False
    return all((out / f"step{s}" / "model.safetensors").exists() for s in config.checkpoint_steps())


def _check_out_dir(out: Path, config: TinyLMConfig, overwrite: bool) -> None:
    marker = out / MARKER
    if marker.exists() and not overwrite:
        try:
            other = read_json(marker).get("config_hash")
        except (OSError, json.JSONDecodeError):
            other = None
        if other != config.config_hash():
            raise TinyLMError(
                f"{out} holds a tiny-LM run with a different config; "
                "use another output folder or pass overwrite=True"
            )


def train_tiny_lm(
    out_dir: str | os.PathLike,
    config: TinyLMConfig | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
    threads: int | None = None,
    on_step: Callable | None = None,
    retrain: bool = False,
) -> Path:
    """Train (or reuse) a tiny GPT-NeoX run in ``out_dir``; return ``out_dir`` as a Path.

    A finished run of the same config is reused without training. A finished run of another
    config raises TinyLMError unless ``overwrite`` (then its marker is replaced and every
    ``step<N>/`` folder this config saves is rewritten). ``threads`` sets torch's intra-op
    threads for the training only (None keeps torch's default; 1 is best on a busy machine).
    ``on_step(step, model, optimizer, scheduler)`` is called at step 0 and after every update
    (see the module docstring); ``retrain`` trains even when a finished run of ``config`` exists
    (the same seed gives the same weights), e.g. so that ``on_step`` sees the training.
    """

    config = config or TinyLMConfig()
    config.validate()
    out = Path(out_dir)
    if is_complete(out, config) and not retrain:
        return out
    if out.exists() and not out.is_dir():
        raise TinyLMError(f"{out} exists and is not a folder; choose another output folder")
    _check_out_dir(out, config, overwrite)
    if threads is not None and threads < 1:
        raise TinyLMError(f"threads must be >= 1, got {threads}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    with torch_threads(threads):
        _train(out, config, progress, on_step)
    return out


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block on ``threads`` intra-op threads (None: leave them), then restore the count."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_updates(model, optimizer, tokenizer, out: Path, config: TinyLMConfig,
                batch: Callable, *, desc: str, progress: bool,
                on_step: Callable | None = None) -> tuple[list[float], list[float]]:
    """The update loop shared by the tiny LM and the planted tasks: ``config.steps`` updates at
    the schedule's mean rate over each (``update_lr``, so the rates sum to tau; a param group's
    ``lr_scale`` multiplies its rate), on ``batch(step)`` (B, T) token ids, clipped, saving
    ``step<N>/`` at the log-spaced steps and the schedule; ``on_step(step, model, optimizer,
    None)`` after each (and at step 0).
    Returns the per-update losses and rates."""
    import torch
    from tqdm.auto import tqdm

    save_steps = set(config.checkpoint_steps())
    write_json(out / SCHEDULE, config.schedule())
    if 0 in save_steps:
        save_checkpoint(model, tokenizer, out, 0)
    if on_step is not None:
        on_step(0, model, optimizer, None)
    losses: list[float] = []
    lrs: list[float] = []
    bar = tqdm(range(1, config.steps + 1), desc=desc, unit="step", disable=not progress)
    for step in bar:
        lr = update_lr(step, config)
        for group in optimizer.param_groups:  # a group may run at a multiple of the rate
            group["lr"] = lr * group.get("lr_scale", 1.0)
        ids = batch(step)  # (B, T)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        lrs.append(lr)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if step in save_steps:
            save_checkpoint(model, tokenizer, out, step)
        if on_step is not None:
            on_step(step, model, optimizer, None)
    bar.close()
    return losses, lrs


def _train(out: Path, config: TinyLMConfig, progress: bool, on_step: Callable | None) -> None:
    """The training loop proper; writes the checkpoints, the logs and, last, the marker."""
    import torch
    from transformers import GPTNeoXForCausalLM

    started = time.perf_counter()
    tokenizer = corpus.build_tokenizer(model_max_length=max(2048, config.seq_len))
    data = training_tokens(config, tokenizer)  # (S, B, T)
    torch.manual_seed(config.seed)
    model = GPTNeoXForCausalLM(model_config(config, tokenizer))
    model.set_attn_implementation("sdpa")
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr_max, betas=config.betas, eps=1e-8,
        weight_decay=config.weight_decay,
    )
    save_steps = set(config.checkpoint_steps())
    losses, lrs = run_updates(model, optimizer, tokenizer, out, config,
                              lambda step: data[step - 1], desc="tiny-LM", progress=progress,
                              on_step=on_step)

    seconds = time.perf_counter() - started
    write_json(
        out / TRAIN_LOG,
        {"format": 1, "step": list(range(1, config.steps + 1)), "loss": losses, "lr": lrs,
         "seconds": seconds, "tokens_per_step": config.batch_size * config.seq_len},
    )
    write_json(
        out / MARKER,
        {"format": 1, "config": asdict(config), "config_hash": config.config_hash(),
         "checkpoint_steps": sorted(save_steps), "torch": torch.__version__},
    )
