"""Builders the tests share: tiny random-init models of several architectures, a saved
checkpoint sequence, evaluation windows and the embedded corpus's held-out text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
)

from peakprobe import results
from peakprobe.corpus import build_tokenizer
from peakprobe.data import EvalData, token_hash

VOCAB = 97


def tiny_config(arch: str):
    """A 2-layer config of ``arch`` small enough for float64 reference checks."""
    common = dict(
        vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    llama_like = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **common
    )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            rotary_pct=0.25, **common,
        )
    if arch == "gpt2":
        return GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB, bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "llama_gqa":
        return LlamaConfig(num_key_value_heads=2, **llama_like)
    if arch == "qwen2":
        return Qwen2Config(num_key_value_heads=2, **llama_like)
    if arch == "olmo2":
        return Olmo2Config(num_key_value_heads=4, **llama_like)
    if arch == "mistral_sliding":
        return MistralConfig(num_key_value_heads=2, sliding_window=5, **llama_like)
    if arch == "gemma2_softcap":
        return Gemma2Config(
            num_key_value_heads=2, head_dim=8, sliding_window=5, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, query_pre_attn_scalar=8, **llama_like,
        )
    raise KeyError(arch)


ARCHS = ["gpt_neox", "gpt2", "llama_gqa", "qwen2", "olmo2", "mistral_sliding", "gemma2_softcap"]


def tiny_model(arch: str, *, dtype=torch.float64, attn: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_config(tiny_config(arch), **kwargs)
    # Random init is nearly uniform attention; scale query/key weights up so the heads have
    # real structure (some peaked rows) and the statistics are not all trivially equal.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("q_proj", "k_proj", "query_key_value", "c_attn")) and p.dim() == 2:
                p.mul_(25.0)
    return model.eval()


def left_padded_batch(seed: int = 1, batch: int = 3, length: int = 12, pads=(0, 4, 7)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads[:batch]):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


STEPS = [0, 1, 2, 4, 8, 16, 32, 64]


def _sequence_model(step: int):
    tok = build_tokenizer()
    cfg = GPTNeoXConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(1000 + step)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # attention sharpens with "training": scale q/k like (1 + step)^(1/3)
        for layer in model.gpt_neox.layers:
            layer.attention.query_key_value.weight.mul_((1 + step) ** (1 / 3))
    return model.eval(), tok


def write_sequence(folder: Path, steps=STEPS) -> dict:
    """save_pretrained folders step<N>/ plus a schedule; returns the in-memory models."""
    models = {}
    for step in steps:
        model, tok = _sequence_model(step)
        model.save_pretrained(folder / f"step{step}")
        tok.save_pretrained(folder / f"step{step}")
        models[f"step{step}"] = model
    results.write_json(folder / "schedule.json", {
        "kind": "warmup_cosine", "lr_max": 1e-3, "warmup_steps": 2, "total_steps": 64,
        "final_lr_ratio": 0.1,
    })
    return models


def eval_data(n: int = 4, t: int = 24) -> EvalData:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (n, t), generator=g)
    return EvalData(ids, torch.ones_like(ids), "random", token_hash(ids))



def embedded_text(n_docs: int = 200) -> str:
    """Held-out documents of the embedded corpus as a .txt body, one paragraph per document."""
    from peakprobe import corpus

    return "\n\n".join(corpus.generate_documents(n_docs, seed=corpus.EVAL_SEED))
