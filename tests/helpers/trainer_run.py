"""Test helper, and a torchrun script: a tiny GPT-NeoX trained by the HF Trainer on CPU,
optionally with peakprobe's callback.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/trainer_run.py OUT

trains with the callback in two gloo processes and prints, per rank, how many probes it wrote.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from peakprobe.data import EvalData, token_hash

VOCAB = 61
WINDOW = 32
STEPS = 60
SAVE_EVERY = 20


def tiny_neox(dropout: float = 0.1, seed: int = 0) -> GPTNeoXForCausalLM:
    """2 layers x 4 heads, dropout on attention and residual (so the RNG matters)."""
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
        hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=0, eos_token_id=0,
    )
    return GPTNeoXForCausalLM(config)


def windows(n: int, seed: int) -> torch.Tensor:
    """(n, WINDOW) token windows whose second half repeats the first (learnable by attention)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(1, VOCAB, (n, WINDOW // 2), generator=g)
    return torch.cat([half, half], dim=1)  # (n, WINDOW)


def train_dataset(n: int = 4 * STEPS) -> list[dict]:
    return [{"input_ids": row, "labels": row} for row in windows(n, seed=1)]


def eval_windows(n: int = 4) -> EvalData:
    ids = windows(n, seed=2)
    return EvalData(ids, torch.ones_like(ids), "repeat-windows", token_hash(ids))


def train(out: Path, *, callback: bool, report_to: tuple[str, ...] = (), n_points: int = 8,
          logging_steps: int = 1, save: bool = True):
    """Train STEPS updates (checkpoint-<N>/ every SAVE_EVERY if ``save``); (trainer, callback)."""
    from transformers import Trainer, TrainingArguments

    from peakprobe.integrations import PeakprobeCallback

    args = TrainingArguments(
        str(out / "trainer"), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=5, weight_decay=0.01, logging_steps=logging_steps,
        save_strategy="steps" if save else "no", save_steps=SAVE_EVERY, save_only_model=True,
        report_to=list(report_to), use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=tiny_neox(), args=args, train_dataset=train_dataset())
    cb = None
    if callback:
        cb = PeakprobeCallback(trainer, eval_windows(), out / "run", n_points=n_points,
                               every=SAVE_EVERY)
        trainer.add_callback(cb)
    trainer.train()
    return trainer, cb


if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer, cb = train(Path(sys.argv[1]), callback=True, logging_steps=10)
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank} of {trainer.args.world_size}: {len(cb.monitor.done)} probes", flush=True)
