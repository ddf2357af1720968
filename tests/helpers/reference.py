"""Independent float64 references the exactness tests share: the tiny models (the helpers'
architectures and a gpt-oss with learned sinks) and every statistic of one row of logits
recomputed in numpy (beta_eff by scipy's brentq on the tabulated curve)."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import entr
from transformers import AutoModelForCausalLM, GptOssConfig

from peakprobe import vocab
from peakprobe.probes._entropy_curve import B_GRID, H_TABLE, N_GRID

from . import ARCHS, VOCAB
from . import tiny_config as _tiny_config
from . import tiny_model as _tiny_model

ALL_ARCHS = ARCHS + ["gpt_oss"]


def tiny_config(arch: str):
    if arch != "gpt_oss":
        return _tiny_config(arch)
    return GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def tiny_model(arch: str, *, attn: str | None = None):
    if arch != "gpt_oss":
        return _tiny_model(arch, attn=attn)
    torch.manual_seed(0)
    kwargs = {"dtype": torch.float64, "experts_implementation": "eager"}  # float64 experts
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_config(tiny_config(arch), **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("q_proj" in name or "k_proj" in name) and p.dim() == 2:
                p.mul_(25.0)
            if name.endswith("sinks"):  # sinks that take real probability, some heads more
                p.copy_(torch.linspace(-2.0, 6.0, p.numel(), dtype=p.dtype))
    return model.eval()


def _curve(beta: float, n: int) -> float:
    """The tabulated E[H](beta, n): linear in log n between rows, linear in b = beta/sqrt(2 ln n)."""
    ln = np.log(np.asarray(N_GRID, dtype=float))
    x = min(max(math.log(n), ln[0]), ln[-1])
    i = min(max(int(np.searchsorted(ln, x, side="right")), 1), len(ln) - 1)
    w = (x - ln[i - 1]) / (ln[i] - ln[i - 1])
    row = (1 - w) * np.asarray(H_TABLE[i - 1]) + w * np.asarray(H_TABLE[i])
    b = min(beta / math.sqrt(2 * math.log(n)), B_GRID[-1])
    return float(np.interp(b, B_GRID, row)) * math.log(n)


def _beta_eff(entropy: float, n: int) -> float:
    c0 = math.sqrt(2 * math.log(n))
    top = B_GRID[-1] * c0
    if entropy >= _curve(0.0, n):
        return 0.0
    if entropy <= _curve(top, n):
        return top
    return brentq(lambda b: _curve(b, n) - entropy, 0.0, top, xtol=1e-14, rtol=1e-15)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def _row_stats(z: np.ndarray, p_first: bool, sink: float | None = None) -> dict[str, float]:
    """Every statistic of one row of logits z; ``sink``: a learned sink logit, one more softmax
    option (in the probabilities, not in the logit statistics)."""
    options = z if sink is None else np.append(z, sink)
    p = _softmax(options)
    n, n_opt = z.size, options.size
    srt = np.sort(z)[::-1]
    entropy = float(entr(p).sum())
    vals = {
        "entropy": entropy,
        "max_prob": float(p.max()),
        "logit_std": float(z.std()),
        "logit_max_minus_mean": float(z.max() - z.mean()),
        "peaked": float(z.std() > math.sqrt(2 * math.log(n))),
        vocab.LOGIT_ROW_MAX: float(z.max()),
    }
    if p_first:
        vals["first_key_prob"] = float(p[0])
    if sink is not None:
        vals[vocab.SINK_PROB] = float(p[-1])
    if n_opt > 1:
        vals["entropy_norm"] = entropy / math.log(n_opt)
        b = _beta_eff(entropy, n_opt)
        vals[vocab.BETA_EFF] = b
        vals[vocab.PEAKED_ENTROPY] = float(b > math.sqrt(2 * math.log(n_opt)))
    if n > 1:
        vals["logit_top_gap"] = float(srt[0] - srt[1])
    if p_first and n > 2:
        rest = z[1:]
        q = _softmax(rest)
        h = float(entr(q).sum())
        b = _beta_eff(h, n - 1)
        c0 = math.sqrt(2 * math.log(n - 1))
        x = {"entropy": h, "max_prob": float(q.max()), "logit_std": float(rest.std()),
             "peaked": float(rest.std() > c0), vocab.BETA_EFF: b, vocab.PEAKED_ENTROPY: float(b > c0)}
        vals.update({k + vocab.XSINK_SUFFIX: v for k, v in x.items()})
    return vals
