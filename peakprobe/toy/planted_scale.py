"""The planted attention bottleneck: a hand-built one-head GPT-NeoX whose only lagging quantity is
the head's inverse temperature.

The ``attention`` task of ``peakprobe.toy.planted`` (scored copy): every token ``w`` has a fixed
score ``s(w)``, equally spaced on [-sqrt(3), sqrt(3)] (std 1) and shuffled over the vocabulary;
``x[t+1]`` is, with probability ``1 - noise``, ``f(w*)`` where ``w*`` is the highest-scoring
token of ``x[0..t]`` and ``f`` a fixed permutation, else a uniform token. Predicting it needs one
head that puts all its mass on the best-scoring key. This module builds that model by hand
(1 layer, 1 head, the MLP zero), so that the bottleneck is known by construction:

```
residual dims  [0, V1)        one-hot of the current token          (embedding)
               [V1, 2 V1)     one-hot of f(attended token)          (written by the head)
               2 V1           phi(w): the score feature              (embedding)
               2 V1 + 1       1                                      (embedding)
head           query  = theta e_2 (the query bias; theta is the one trained number)
               key    = sqrt(d) psi(w) e_2, psi(w) = LN1(embedding)[2 V1] = s(w) exactly
               value  = LN1(embedding)[0, V1): the token's one-hot, as LN1 scales it
               output = the value's one-hot moved to f(token) in [V1, 2 V1)
LM head        c * (copy region), and <unk> (never seen) pushed down through the constant dim
```

The head's logit for key j is ``theta * s(x_j)`` (rotary acts on head dims 0-1 only, which carry
nothing): one direction, fixed and right, so the student is aligned from the start and only its
magnitude ``theta`` (the softmax's inverse temperature) has to grow, from 0 — the teacher-student
premise of the 1/3 law inside an attention head. The scores are a continuum of margins (equally
spaced, 2 sqrt(3) / (V - 1) apart), so the loss of a head at temperature 1 / theta falls as
about c / theta until theta approaches (V - 1) / (2 sqrt(3)) (73 at 255 tokens).

The read-out scale ``c`` is calibrated so that the model with a perfect (argmax) attention gives
its best loss (``calibrate_readout``): then the LM head is at its optimal temperature once the head
is sharp, and everything between the model and that floor is the head's temperature. The LM head's
target (``1 - noise + noise / n`` on one token) is far from peaked.
"""

from __future__ import annotations

import math

import numpy as np

SCORE_HALF_WIDTH = math.sqrt(3.0)  # scores equally spaced on [-sqrt 3, sqrt 3]: std 1
UNK_PUSH = -16.0  # the <unk> row's weight on the constant dim: its logit sits far below the rest
ROTARY_DIMS = 2  # head dims 0-1 carry the rotary embedding and nothing else
SHARP = 1.0e4  # theta of a perfect (argmax) head: margins of SHARP * 2 sqrt 3 / (V - 1) nats
_QUERY_DIM = ROTARY_DIMS  # the head dim that carries theta (query) and psi (key)


def hidden_size(n_tokens: int) -> int:
    """Residual width of the scored-copy model: two one-hot blocks, the score and the constant."""
    return 2 * (n_tokens + 1) + 2


def rotary_pct(n_tokens: int) -> float:
    """The partial rotary factor giving exactly ROTARY_DIMS rotary dims (int() of the product)."""
    return (ROTARY_DIMS + 0.5) / hidden_size(n_tokens)


def token_scores(n_tokens: int, seed: int) -> np.ndarray:
    """s(w) for the task tokens 0..n-1: equally spaced on [-sqrt 3, sqrt 3], shuffled. (n,) float64."""
    grid = np.linspace(-SCORE_HALF_WIDTH, SCORE_HALF_WIDTH, n_tokens)
    return grid[np.random.default_rng([seed, 17]).permutation(n_tokens)]


def copy_map(n_tokens: int, seed: int) -> np.ndarray:
    """f: a fixed random permutation of the task tokens (n,) int64; the copied token is f(w*)."""
    return np.random.default_rng([seed, 19]).permutation(n_tokens).astype(np.int64)


def _layer_norm_feature(phi: np.ndarray, d: int, eps: float) -> np.ndarray:
    """LN1(embedding)[score dim] for an embedding (one 1, phi, one 1, zeros) of width d."""
    mean = (2.0 + phi) / d
    var = (2.0 + phi * phi) / d - mean * mean
    return (phi - mean) / np.sqrt(var + eps)


def score_features(scores: np.ndarray, d: int, eps: float) -> np.ndarray:
    """phi with LN1(embedding)[score dim] == scores, solved by bisection (the map is increasing)."""
    lo, hi = np.full_like(scores, -1e3), np.full_like(scores, 1e3)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        below = _layer_norm_feature(mid, d, eps) < scores
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def build_model(config, tokenizer, readout_scale: float = 1.0):
    """The scored-copy GPT-NeoX of ``config`` (a PlantedConfig), theta = 0 (uniform attention)."""
    import torch
    from transformers import GPTNeoXForCausalLM

    from .tiny_lm import model_config

    n = config.n_tokens
    v1, d = n + 1, hidden_size(n)
    hf_config = model_config(config.model, tokenizer)
    if hf_config.hidden_size != d or hf_config.num_attention_heads != 1 or hf_config.num_hidden_layers != 1:
        raise ValueError("the scored-copy model needs 1 layer, 1 head and hidden_size(n_tokens)")
    torch.manual_seed(config.model.seed)
    model = GPTNeoXForCausalLM(hf_config)
    attn = model.gpt_neox.layers[0].attention
    if attn.rotary_ndims != ROTARY_DIMS:
        raise ValueError(f"rotary dims {attn.rotary_ndims}, expected {ROTARY_DIMS}")
    phi = score_features(token_scores(n, config.task_seed), d, hf_config.layer_norm_eps)
    f = copy_map(n, config.task_seed)
    score_dim, const_dim = 2 * v1, 2 * v1 + 1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.gpt_neox.embed_in.weight  # (V1, d); token id i + 1 is task token i
        emb[:, :v1] = torch.eye(v1)
        emb[1:, score_dim] = torch.from_numpy(phi).to(emb.dtype)
        emb[0, score_dim] = float(phi.min()) - 10.0  # <unk>: below every score (never occurs)
        emb[:, const_dim] = 1.0
        layer = model.gpt_neox.layers[0]
        for ln in (layer.input_layernorm, layer.post_attention_layernorm, model.gpt_neox.final_layer_norm):
            ln.weight.fill_(1.0)
        qkv = attn.query_key_value.weight  # (3d, d): rows q, k, v of the one head
        qkv[d + _QUERY_DIM, score_dim] = math.sqrt(d)  # key dim 2 = sqrt(d) psi; scaling 1/sqrt(d)
        qkv[2 * d: 2 * d + v1, :v1] = torch.eye(v1)  # value: the one-hot block of LN1(x)
        move = torch.zeros(v1, v1)
        move[0, 0] = 1.0
        move[torch.from_numpy(f + 1), torch.arange(1, v1)] = 1.0  # value dim i + 1 -> f(i) + 1
        attn.dense.weight[v1:2 * v1, :v1] = move
        out = model.get_output_embeddings().weight  # (V1, d)
        out[:, v1:2 * v1] = torch.eye(v1)
        out[0, const_dim] = UNK_PUSH
        out.mul_(readout_scale)
    return model


def query_bias(model):
    """The bias vector holding theta (query bias entry ``_QUERY_DIM``)."""
    return model.gpt_neox.layers[0].attention.query_key_value.bias


def get_theta(model) -> float:
    """The head's inverse temperature theta (its logit for key j is theta * s(x_j))."""
    return float(query_bias(model).detach()[_QUERY_DIM])


def set_theta(model, theta: float) -> None:
    import torch

    with torch.no_grad():
        query_bias(model)[_QUERY_DIM] = theta


def train_only_theta(model, readout: bool = False) -> list:
    """Freeze everything but theta (and the LM head's weight when ``readout``); returns the
    parameter groups for the optimizer (the LM head's carries ``lr_scale``, set by the caller)."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    bias = query_bias(model)
    bias.requires_grad_(True)
    keep = torch.zeros_like(bias)
    keep[_QUERY_DIM] = 1.0
    bias.register_hook(lambda g: g * keep)  # every other bias entry stays exactly as built
    groups = [{"params": [bias]}]
    if readout:
        head = model.get_output_embeddings().weight
        head.requires_grad_(True)
        groups.append({"params": [head]})
    return groups


def calibrate_readout(model, ids, *, bounds: tuple[float, float] = (1e-3, 10.0)) -> float:
    """Scale the LM head so that the model with a perfect head (theta = SHARP) has its lowest
    mean next-token loss on ``ids`` (B, T); returns the scale applied. theta is restored."""
    import torch
    from scipy.optimize import minimize_scalar

    theta = get_theta(model)
    head = model.get_output_embeddings().weight
    base = head.detach().clone()
    set_theta(model, SHARP)

    def loss(scale: float) -> float:
        with torch.no_grad():
            head.copy_(base * scale)
            return float(model(input_ids=ids, labels=ids).loss)

    try:
        best = minimize_scalar(loss, bounds=bounds, method="bounded", options={"xatol": 1e-5})
    finally:
        set_theta(model, theta)
    with torch.no_grad():
        head.copy_(base * best.x)
    return float(best.x)
