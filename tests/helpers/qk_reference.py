"""Test-only references for the weight figure ``qk_spectral_norm``: tiny models of the fused
layouts the helpers' architectures lack (Phi-3, Persimmon) and of a per-head q/k norm (Qwen3),
and an independent recovery of each head's W_Q, W_K from the model's own computation.

The recovery knows nothing of the weight layouts: at position 0 rotary is the identity, so the
query and key the attention function receives are affine in the attention module's input x.
Many random inputs (``inputs_embeds``, one position) give (x, q, k) samples per layer; least
squares on [x, 1] (the constant column takes the biases) recovers W_Q,h and W_K,h, in float64.
A LayerNorm's output lies in a hyperplane (it is centred), where W is not identifiable: the
recovery runs on a copy of the model whose LayerNorms are the identity (the projections are
untouched), and checks that [x, 1] has full column rank.
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PersimmonConfig, Phi3Config, Qwen3Config

from . import VOCAB
from .reference import tiny_model as _reference_model

#: architectures beyond ``reference.ALL_ARCHS``
EXTRA_ARCHS = ["phi3", "persimmon", "qwen3"]
#: architectures whose q and k are normalised after the projection: no linear recovery
QK_NORMED = ("olmo2", "qwen3")


def _extra_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "phi3":
        return Phi3Config(num_key_value_heads=2, **common)
    if arch == "persimmon":  # fused (H, 3, d) like GPT-NeoX, here without its q/k layer norms
        return PersimmonConfig(qk_layernorm=False, **common)
    if arch == "qwen3":
        return Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    raise KeyError(arch)


def qk_model(arch: str) -> torch.nn.Module:
    """A float64 tiny model of ``arch`` (``reference.ALL_ARCHS`` or ``EXTRA_ARCHS``), eager attention."""
    if arch not in EXTRA_ARCHS:
        return _reference_model(arch, attn="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_extra_config(arch), dtype=torch.float64,
                                             attn_implementation="eager")
    return model.eval()


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that call an ``eager_attention_forward``, in layer order."""
    found = []
    for m in model.modules():
        owner = sys.modules.get(type(m).__module__)
        if owner is not None and hasattr(owner, "eager_attention_forward") and type(m).__name__.endswith("Attention"):
            found.append(m)
    return found


@contextmanager
def _capture(model: torch.nn.Module, store: dict):
    """Record, per attention module, its input x and the (q, k, scaling) its eager attention
    function receives (the modeling file's function, wrapped for the block)."""
    mods = _attention_modules(model)
    index = {id(m): i for i, m in enumerate(mods)}
    owners = {sys.modules[type(m).__module__] for m in mods}
    originals = {o: o.eager_attention_forward for o in owners}

    def pre(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        store.setdefault(index[id(module)], {})["x"] = x.detach().clone()

    def wrapped(original):
        def fn(module, query, key, value, attention_mask, **kw):
            rec = store.setdefault(index[id(module)], {})
            rec["q"], rec["k"] = query.detach().clone(), key.detach().clone()
            rec["scaling"] = kw.get("scaling") if kw.get("scaling") is not None else query.shape[-1] ** -0.5
            return original(module, query, key, value, attention_mask, **kw)
        return fn

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in mods]
    for o, f in originals.items():
        o.eager_attention_forward = wrapped(f)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for o, f in originals.items():
            o.eager_attention_forward = f


def _solve(x1: np.ndarray, y: np.ndarray) -> np.ndarray:
    """W (d, D) of y = x W^T + b by least squares: ``x1`` (n, D + 1) = [x, 1], ``y`` (n, d)."""
    coef, *_ = np.linalg.lstsq(x1, y, rcond=None)  # (D + 1, d)
    assert np.abs(x1 @ coef - y).max() <= 1e-9 * max(1.0, np.abs(y).max()), "not affine in x"
    return coef[:-1].T


def recovered_spectral_norms(model: torch.nn.Module, n: int = 160, seed: int = 0) -> dict[int, np.ndarray]:
    """layer -> (H,) scaling * ||W_Q,h^T W_K,h||_2 from least squares on ``n`` random
    one-position inputs (the module doc); the fit's residual must be at rounding level."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.LayerNorm):  # centred outputs: W unidentifiable (module doc)
            model.set_submodule(name, torch.nn.Identity())
    d_model = model.get_input_embeddings().weight.shape[1]
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(n, 1, d_model, generator=g, dtype=torch.float64)
    store: dict = {}
    with _capture(model, store), torch.no_grad():
        model(inputs_embeds=embeds, use_cache=False)
    out = {}
    for layer, rec in sorted(store.items()):
        x = rec["x"][:, 0].numpy()  # (n, D)
        q, k = rec["q"][:, :, 0].numpy(), rec["k"][:, :, 0].numpy()  # (n, H, d), (n, Hkv, d)
        h, hkv = q.shape[1], k.shape[1]
        x1 = np.concatenate([x, np.ones((n, 1))], 1)  # (n, D + 1)
        assert np.linalg.matrix_rank(x1) == x1.shape[1], "inputs do not span the projection's domain"
        wk = [_solve(x1, k[:, j]) for j in range(hkv)]
        norms = [np.linalg.svd(_solve(x1, q[:, i]).T @ wk[i // (h // hkv)], compute_uv=False)[0]
                 for i in range(h)]
        out[layer] = float(rec["scaling"]) * np.array(norms)
    return out


def weight_spectral_norms(model: torch.nn.Module) -> dict[int, np.ndarray]:
    """layer -> (H,) scaling * ||W_Q,h^T W_K,h||_2 read straight from separate q_proj / k_proj
    weights (numpy SVD of the (D, D) product), for the q/k-normalised models."""
    out = {}
    for layer, m in enumerate(_attention_modules(model)):
        wq, wk = m.q_proj.weight.detach().numpy(), m.k_proj.weight.detach().numpy()
        d, dim = m.head_dim, wq.shape[1]
        wq, wk = wq.reshape(-1, d, dim), wk.reshape(-1, d, dim)
        g = wq.shape[0] // wk.shape[0]
        norms = [np.linalg.svd(wq[i].T @ wk[i // g], compute_uv=False)[0] for i in range(wq.shape[0])]
        out[layer] = m.scaling * np.array(norms)
    return out
