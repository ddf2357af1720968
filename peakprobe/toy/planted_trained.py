"""The trained scored-copy controls: the hand-built scored-copy model of ``planted_scale`` with
its query and key maps (or its LM head's input scale) trained, and the oracle excess of each
checkpoint. The tasks and what they plant: docs/planted.md.

* ``trained_qk`` (positive control): the full query map and a key map that reads only the score
  feature (key bias aside; the rotary rows stay zero) train from a small start by plain SGD. The
  key of token ``w`` is ``psi(w) k``, so the head's logit for key j is ``theta_t psi(x_j)`` with
  ``theta_t = q_t . k / sqrt(d)``: the ranking is right once ``theta_t > 0`` and only the scale
  lags.
* ``blind_spot``: the same with a key map that reads every feature (token one-hots included), so
  the head may also mis-rank keys: attention can limit the loss through its ranking.
* ``trained_lm_head`` (LM-head twin): the head is the hand-built sharp one and frozen; only the
  final layer norm's scale, the LM head's inverse temperature, trains from a small start.

``oracle_losses`` gives, per checkpoint, the loss with the head's softmax replaced by a one-hot
on the true best key (the hand-built sharp head), so ``L - L_oracle`` is the loss attention
leaves, known independently of any gain.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from peakprobe.hf import quiet_transformers_progress
from peakprobe.toy import planted_scale

TRAINED_QK_TASK = "trained_qk"
BLIND_SPOT_TASK = "blind_spot"
LM_HEAD_TWIN_TASK = "trained_lm_head"
TRAINED_TASKS: tuple[str, ...] = (TRAINED_QK_TASK, BLIND_SPOT_TASK, LM_HEAD_TWIN_TASK)
TRAINED_TOKENS = 127  # scores 2 sqrt(3) / 126 apart: a continuum of margins up to theta ~ 36
INIT_STD = 4e-3  # the query and key maps' start: near-uniform attention, a take-off before step 20
LN_INIT = 0.02  # trained_lm_head: the final layer norm's starting scale (the LM head's temperature)
LM_HEAD_TWIN_NOISE = 0.2  # the LM head's target is then peaked (beta_eff 4.2 > sqrt(2 ln 128))
LR_MAX = 0.3  # plain SGD: the excess falls from about 0.4 to 0.02 nats over the fit window


def _dims(model) -> tuple[int, int, int]:
    """(d, score column, constant column) of the scored-copy model."""
    d = model.config.hidden_size
    v1 = (d - 2) // 2
    return d, 2 * v1, 2 * v1 + 1


def _masked(param, keep) -> None:
    """Train ``param`` only where ``keep`` (same shape) is 1: the rest stays exactly as built."""
    param.requires_grad_(True)
    param.register_hook(lambda g: g * keep)


def prepare(model, task: str, seed: int) -> list[dict]:
    """Set the built (calibrated) scored-copy ``model`` up for ``task``: the trained weights'
    start and masks; returns the optimizer's parameter groups."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    if task == LM_HEAD_TWIN_TASK:  # the head stays sharp; the LM head's input scale lags
        planted_scale.set_theta(model, planted_scale.SHARP)
        ln = model.gpt_neox.final_layer_norm.weight
        with torch.no_grad():
            ln.fill_(LN_INIT)
        ln.requires_grad_(True)
        return [{"params": [ln]}]
    d, score, _ = _dims(model)
    rot = planted_scale.ROTARY_DIMS
    qkv = model.gpt_neox.layers[0].attention.query_key_value
    gen = torch.Generator().manual_seed(seed)
    keep_w = torch.zeros_like(qkv.weight)  # (3d, d): rows q, k, v
    keep_w[:d] = 1.0  # the full query map
    keys = slice(d + rot, 2 * d)  # the key's non-rotary rows
    if task == BLIND_SPOT_TASK:
        keep_w[keys] = 1.0  # every feature
    else:
        keep_w[keys, score] = 1.0  # the score feature alone
    keep_b = torch.zeros_like(qkv.bias)
    keep_b[:d] = 1.0
    with torch.no_grad():
        qkv.bias[:d].zero_()
        start = INIT_STD * torch.randn(qkv.weight.shape, generator=gen)
        # the key column's entries scaled as the hand-built key's (sqrt(d) per unit of psi)
        start[keys, score] *= math.sqrt(d)
        qkv.weight[: 2 * d] = (start * keep_w)[: 2 * d]
    _masked(qkv.weight, keep_w)
    _masked(qkv.bias, keep_b)
    return [{"params": [qkv.weight, qkv.bias]}]


def _sharpen(model) -> None:
    """Replace the head's query and key maps by the hand-built sharp ones (one-hot on the best key)."""
    import torch

    d, score, _ = _dims(model)
    qkv = model.gpt_neox.layers[0].attention.query_key_value
    q_dim = planted_scale.ROTARY_DIMS
    with torch.no_grad():
        qkv.weight[: 2 * d].zero_()
        qkv.bias[: 2 * d].zero_()
        qkv.weight[d + q_dim, score] = math.sqrt(d)
        qkv.bias[q_dim] = planted_scale.SHARP


def oracle_losses(checkpoints: Path, steps: list[int], ids) -> list[dict]:
    """Per checkpoint step: the mean next-token loss on ``ids`` (B, T) token ids, and the loss
    with the head's softmax replaced by a one-hot on the true best key (float32, as the sweep)."""
    import torch
    from transformers import GPTNeoXForCausalLM

    rows = []
    for step in steps:
        with quiet_transformers_progress():
            model = GPTNeoXForCausalLM.from_pretrained(checkpoints / f"step{step}")
        model.eval()
        with torch.no_grad():
            loss = float(model(input_ids=ids, labels=ids).loss)
            _sharpen(model)
            oracle = float(model(input_ids=ids, labels=ids).loss)
        rows.append({"step": int(step), "loss": loss, "oracle_loss": oracle,
                     "oracle_excess": loss - oracle})
    return rows


def gain_beside_oracle(rows: list[dict], gains: dict[int, float], window: tuple[int, int]) -> dict:
    """The oracle rows with the attention gain G of each step beside them, and the largest
    |G - (L - L_oracle)| / (L - L_oracle) over the fit window's checkpoints (steps in ``window``)."""
    out, worst = [], 0.0
    for r in rows:
        g = gains.get(r["step"], math.nan)
        out.append({**r, "gain_attention": g})
        if window[0] <= r["step"] <= window[1] and r["oracle_excess"] > 0:
            worst = max(worst, abs(g - r["oracle_excess"]) / r["oracle_excess"])
    return {"rows": out, "window_steps": list(window), "max_rel_error": float(worst)}


def eval_ids(path: Path, seq_len: int):
    """The eval file's sequences as (N, T) token ids (each line one window of ``seq_len`` words)."""
    import json

    import torch

    seqs = [[int(w[1:]) + 1 for w in json.loads(line)["text"].split()]
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return torch.from_numpy(np.asarray(seqs, dtype=np.int64).reshape(-1, seq_len))


ORACLE_FILE = "oracle.json"


def write_oracle(out: Path, config, run_dir: Path) -> dict:
    """Write ``run_dir/oracle.json``: per checkpoint the loss, the oracle loss and excess, and
    the attention gain G (all heads) of the run's results beside them; returns the document."""
    from peakprobe import results, vocab

    steps = list(config.model.checkpoint_steps())
    rows = oracle_losses(out / "checkpoints", steps, eval_ids(out / "eval.jsonl", config.seq_len))
    df = results.read_results(run_dir)
    g = df[(df["site_kind"] == vocab.ATTN_ALL) & (df["metric"] == vocab.GAIN)]
    gains = {int(s): float(v) for s, v in zip(g["step"], g["value"], strict=True)}
    win = results.read_json(run_dir / results.FITS_JSON)["window"]
    doc = {"format": 1, "task": config.task,
           **gain_beside_oracle(rows, gains, (int(win["step_min"]), int(win["step_max"])))}
    results.write_json(run_dir / ORACLE_FILE, doc)
    return doc
