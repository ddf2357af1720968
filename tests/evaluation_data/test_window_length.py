"""Evaluation windows against the model's maximum positions, through the command line.

Defect: a GPT-2 checkpoint with n_positions 64 probed with 256-token windows died with an
IndexError traceback, and a Qwen3 checkpoint with max_position_embeddings 128 silently ran
256-token windows past its trained context. Now an explicit window longer than the model's
maximum positions is a one-line error (exit 2, nothing written), and the default window
(1024 tokens) is clamped to them with a one-line notice.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Qwen3Config

from peakprobe import corpus
from peakprobe.cli import main


def _config(arch: str, tok):
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if arch == "gpt2":  # learned positions: a position past 63 has no embedding
        return GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, **ids)
    return Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       max_position_embeddings=128, **ids)


@pytest.fixture(params=[("gpt2", 64), ("qwen3", 128)], ids=["gpt2-n_positions-64", "qwen3-max-128"])
def short_run(request, tmp_path):
    arch, limit = request.param
    tok = corpus.build_tokenizer()
    for step in (10, 20):
        torch.manual_seed(step)
        model = AutoModelForCausalLM.from_config(_config(arch, tok))
        model.save_pretrained(tmp_path / "run" / f"step{step}")
        tok.save_pretrained(tmp_path / "run" / f"step{step}")
    docs = corpus.generate_documents(40, seed=5)
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(docs))
    return tmp_path, limit, text


def test_explicit_window_past_the_maximum_positions_is_a_one_line_error(short_run, capsys):
    root, limit, text = short_run
    out = root / "out"
    code = main(["sweep", str(root / "run"), "--out", str(out), "--data", str(text),
                 "--n-windows", "2", "--window", "256", "-q"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("peakprobe: error: ")
    assert f"exceed the model's maximum positions ({limit})" in err[0]
    assert f"--window {limit}" in err[0]
    assert not out.exists()  # refused before anything was written


def test_default_window_is_clamped_with_a_notice(short_run, capsys):
    root, limit, text = short_run
    out = root / "out"
    code = main(["sweep", str(root / "run"), "--out", str(out), "--data", str(text),
                 "--n-windows", "2", "--no-prefetch"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"peakprobe: warning: windows of {limit} tokens" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"]["window"] <= limit
    assert manifest["data"]["layout"] == "document"
