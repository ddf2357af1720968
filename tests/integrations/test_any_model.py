"""Any PyTorch model, probed through its ``F.scaled_dot_product_attention`` calls.

References: the Hugging Face equivalent of each model with the same weights, probed through
transformers' attention interface (every statistic of every head and the LM head, 1e-6 in
float32): GPT-2 for the nanoGPT-style model of docs/any_model.md, and the Llama that OLMo-core's
own converter builds for an OLMo-core model. The docs' example runs as written, and the run
directories it and a 30-step OLMo-core training write are fitted and reported.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers.extras import missing
from transformers import GPT2Config, GPT2LMHeadModel

from peakprobe import results, vocab
from peakprobe.cli import main
from peakprobe.config import ProbeConfig
from peakprobe.hooks import attach
from peakprobe.hooks.sdpa import UnprobedAttentionWarning, attach_sdpa

DOC = Path(__file__).resolve().parents[2] / "docs" / "any_model.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def _tiny_gpt_class():
    scope: dict = {}
    exec(_doc_blocks()[0], scope)
    return scope["TinyGPT"], scope


#: read off a Hugging Face model's output embedding by ``attach`` alone
ATTACH_ONLY = (vocab.HIDDEN_NORM, vocab.UNEMBED_NORM, vocab.QK_SPECTRAL)


def _frame(frame) -> dict:
    return {(r.site_kind, r.layer, r.head, r.metric): (r.value, r.n_rows) for r in frame.itertuples()
            if r.metric not in ATTACH_ONLY}


def _assert_close(got: dict, ref: dict, rel: float = 1e-6) -> None:
    assert got.keys() == ref.keys()
    bins = {n: (hi - lo) / vocab.HIST_BINS for n, (lo, hi) in vocab.HIST_RANGE.items()}
    for key, (value, n) in ref.items():
        g, gn = got[key]
        assert gn == n, key
        if "_q" in key[3]:  # histogram quantiles: rows within rounding of a bin edge may move
            assert abs(g - value) <= bins[key[3].rsplit("_q", 1)[0]] + 1e-6, key
        elif math.isnan(value):
            assert math.isnan(g), key
        else:
            assert g == pytest.approx(value, rel=rel, abs=rel), key


def _gpt2_twin(model) -> GPT2LMHeadModel:
    """The Hugging Face GPT-2 holding ``model``'s weights (Conv1D weights are transposed)."""
    d = model.wte.embedding_dim
    cfg = GPT2Config(vocab_size=model.wte.num_embeddings, n_positions=model.wpe.num_embeddings, n_embd=d,
                     n_layer=len(model.blocks), n_head=model.blocks[0].attn.n_head,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    hf = GPT2LMHeadModel(cfg).eval()
    sd = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias,
          "lm_head.weight": model.lm_head.weight}
    for i, blk in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        sd.update({p + "ln_1.weight": blk.ln_1.weight, p + "ln_1.bias": blk.ln_1.bias,
                   p + "ln_2.weight": blk.ln_2.weight, p + "ln_2.bias": blk.ln_2.bias,
                   p + "attn.c_attn.weight": blk.attn.c_attn.weight.T, p + "attn.c_attn.bias": blk.attn.c_attn.bias,
                   p + "attn.c_proj.weight": blk.attn.c_proj.weight.T, p + "attn.c_proj.bias": blk.attn.c_proj.bias,
                   p + "mlp.c_fc.weight": blk.mlp[0].weight.T, p + "mlp.c_fc.bias": blk.mlp[0].bias,
                   p + "mlp.c_proj.weight": blk.mlp[2].weight.T, p + "mlp.c_proj.bias": blk.mlp[2].bias})
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    return hf


def test_the_nanogpt_style_model_matches_its_hugging_face_twin():
    tiny_gpt, _ = _tiny_gpt_class()
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    with torch.no_grad():  # sharper attention than at initialisation, so the heads differ
        for blk in model.blocks:
            blk.attn.c_attn.weight.mul_(4.0)
    hf = _gpt2_twin(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (3, 40), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    with attach_sdpa(model) as probe:
        probe.run_batch(ids)
        got = _frame(probe.to_frame())
        names = dict(probe.site_names)
    with attach(hf, ProbeConfig()) as probe:
        probe.run_batch(ids)
        ref = _frame(probe.to_frame())
    _assert_close(got, ref)
    assert names == {0: "blocks.0.attn", 1: "blocks.1.attn"}
    assert max(v for k, (v, _) in got.items() if k[3] == vocab.LOGIT_STD and k[0] == "attn") > 1.0


def test_an_attention_the_probe_cannot_see_is_said_once_by_name():
    class Manual(torch.nn.Module):  # softmax attention written out: no sdpa call
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, idx):
            x = self.emb(idx)
            w = (x @ x.transpose(1, 2)).softmax(-1)
            return w @ x @ self.emb.weight.T

    model = Manual()
    ids = torch.randint(0, 16, (2, 6))
    with warnings.catch_warnings(record=True) as seen, attach_sdpa(model) as probe:
        warnings.simplefilter("always")
        probe.run_batch(ids)
        probe.run_batch(ids)
    said = [str(w.message) for w in seen if issubclass(w.category, UnprobedAttentionWarning)]
    assert len(said) == 1 and "Manual made no call of F.scaled_dot_product_attention" in said[0]


def test_the_docs_example_trains_with_a_monitor_and_fit_and_report_read_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, scope = _tiny_gpt_class()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(_doc_blocks()[1], scope)
    run = tmp_path / "runs" / "nanogpt"
    frames = results.read_results(run)
    assert frames["step"].nunique() == len(scope["monitor"].planned)
    assert set(frames["site_kind"]) == {vocab.ATTN, vocab.LM_HEAD}  # statistics, no gains
    assert main(["fit", str(run), "--n-boot", "50", "-q"]) in (0, 1)
    assert main(["report", str(run), "-q"]) == 0


HAVE_OLMO = importlib.util.find_spec("olmo_core") is not None


@pytest.mark.skipif(not HAVE_OLMO, reason=missing("olmo_core", "ai2-olmo-core is not installed (.ci/run installs it)"))
def test_an_olmo_core_model_trained_with_a_monitor_matches_its_hugging_face_llama(tmp_path):
    from olmo_core.nn.hf.convert import convert_state_to_hf
    from olmo_core.nn.transformer import TransformerConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from peakprobe.data import EvalData, token_hash
    from peakprobe.integrations import Monitor

    os.environ.setdefault("OLMO_CORE_NO_TE", "1")
    torch.manual_seed(0)
    vocab_size, t = 128, 32
    cfg = TransformerConfig.llama_like(d_model=64, vocab_size=vocab_size, n_layers=2, n_heads=4,
                                       n_kv_heads=2, rope_theta=10_000, hidden_size_multiple_of=64,
                                       layer_norm_eps=1e-5)
    model = cfg.build(init_device="cpu")
    model.init_weights(max_seq_len=256, device=torch.device("cpu"))
    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    half = torch.randint(0, vocab_size, (4, t // 2), generator=g)
    ids = torch.cat([half, half], 1)
    data = EvalData(ids, torch.ones_like(ids), "repeat", token_hash(ids))
    steps = 30
    monitor = Monitor(data, tmp_path / "run", total_steps=steps, model=model, optimizer=opt, n_points=12,
                      start=3, name="olmo-core-tiny")
    train = torch.cat([torch.randint(0, vocab_size, (8, t // 2), generator=g)] * 2, 1)
    for step in range(steps + 1):
        monitor.step(step)
        if step == steps:
            break
        loss = torch.nn.functional.cross_entropy(model(train)[:, :-1].reshape(-1, vocab_size),
                                                 train[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert main(["fit", str(tmp_path / "run"), "--n-boot", "50", "-q"]) in (0, 1)
    assert main(["report", str(tmp_path / "run"), "-q"]) == 0

    model.eval()
    ff = model.blocks["0"].feed_forward
    hcfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=ff.hidden_size,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rms_norm_eps=1e-5, rope_theta=10_000, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(hcfg).float().eval()
    hf.load_state_dict(convert_state_to_hf(hcfg, model.state_dict()), strict=True)
    with attach_sdpa(model) as probe:
        probe.run_batch(ids)
        got = _frame(probe.to_frame())
    with attach(hf, ProbeConfig()) as probe:
        probe.run_batch(ids)
        ref = _frame(probe.to_frame())
    _assert_close(got, ref)
