"""The tiny-LM trainer: checkpoint folders, schedule and tau, caching, atomicity, determinism.

The slow test trains the default config and checks the demo's promise: a head whose attention
logits are peaked (std > sqrt(2 ln n)) by the last checkpoint, with std growing over the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from scipy.integrate import quad
from scipy.stats import spearmanr

from peakprobe import corpus
from peakprobe.toy import tiny_lm
from peakprobe.toy.tiny_lm import TinyLMConfig, TinyLMError, train_tiny_lm

CAPTURE = "peakprobe_test_capture"  # unregistered after use: hook-hygiene tests look for these
_captured: dict[int, list[torch.Tensor]] = {}


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Causal attention that also records each row's logit std: query/key/value (B, H, T, D)."""
    t = query.shape[2]
    scores = (query @ key.transpose(-1, -2)) * scaling  # (B, H, T, T)
    visible = torch.ones(t, t, dtype=torch.bool).tril()  # (T, T)
    n = visible.sum(-1).to(scores.dtype)  # (T,)
    mean = scores.masked_fill(~visible, 0.0).sum(-1) / n  # (B, H, T)
    var = ((scores - mean[..., None]) ** 2).masked_fill(~visible, 0.0).sum(-1) / n  # (B, H, T)
    _captured.setdefault(module.layer_idx, []).append(var.sqrt())
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # (B, H, T, T)
    return (probs @ value).transpose(1, 2).contiguous(), None  # (B, T, H, D)


def head_logit_stats(folder: Path, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (L, H): mean over rows of the logit std, and the fraction of rows with n > 1
    whose std exceeds sqrt(2 ln n)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(CAPTURE, _capture_attention)
    _captured.clear()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=CAPTURE).eval()
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        AttentionInterface._global_mapping.pop(CAPTURE, None)
    t = input_ids.shape[1]
    threshold = torch.sqrt(2 * torch.log(torch.arange(1, t + 1, dtype=torch.float32)))  # (T,)
    stds, peaked = [], []
    for layer in sorted(_captured):
        std = torch.cat(_captured[layer])  # (B, H, T)
        stds.append(std.mean((0, 2)))
        peaked.append((std > threshold)[..., 1:].float().mean((0, 2)))
    return torch.stack(stds), torch.stack(peaked)  # (L, H), (L, H)


def _reference_lr(s: float, cfg: TinyLMConfig) -> float:
    """Pythia-style schedule written out independently: linear warmup, cosine to the floor."""
    if s < cfg.warmup_steps:
        return cfg.lr_max * s / cfg.warmup_steps
    frac = (s - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)
    lo = cfg.final_lr_ratio * cfg.lr_max
    return lo + 0.5 * (cfg.lr_max - lo) * (1 + math.cos(math.pi * frac))


def _eval_ids(tok, n_windows: int, window: int) -> torch.Tensor:
    ids: list[int] = []
    for doc in corpus.generate_documents(200, seed=corpus.EVAL_SEED):
        ids += tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
        if len(ids) >= n_windows * window:
            break
    return torch.tensor(ids[: n_windows * window]).view(n_windows, window)  # (N, T)


def _tiny(steps: int, **kw) -> TinyLMConfig:
    return dataclasses.replace(TinyLMConfig.quick(), steps=steps, warmup_steps=1, **kw)


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    return train_tiny_lm(out, TinyLMConfig.quick(), progress=False), TinyLMConfig.quick()


def test_quick_run_saves_loadable_checkpoints(quick_run, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXForCausalLM

    out, cfg = quick_run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    steps = cfg.checkpoint_steps()
    assert len(steps) >= 6 and steps[0] == 0 and steps[-1] == cfg.steps
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == sorted(f"step{s}" for s in steps)  # no temporary folders left behind
    previous = None
    for s in steps:
        model = AutoModelForCausalLM.from_pretrained(out / f"step{s}")
        assert isinstance(model, GPTNeoXForCausalLM)
        assert model.config.num_hidden_layers == cfg.n_layers
        assert model.config.vocab_size == len(corpus.VOCAB)
        weights = model.gpt_neox.layers[0].attention.query_key_value.weight.detach().clone()
        if previous is not None:
            assert not torch.equal(weights, previous)
        previous = weights
    tok = AutoTokenizer.from_pretrained(out / f"step{cfg.steps}")
    doc = corpus.generate_documents(1, seed=3)[0]
    assert tok.encode(doc, add_special_tokens=False) == [corpus.VOCAB.index(w) for w in doc.split()]


def test_schedule_json_and_logged_lr_give_tau(quick_run):
    out, cfg = quick_run
    schedule = json.loads((out / "schedule.json").read_text())
    assert schedule == {
        "kind": "warmup_cosine",
        "lr_max": cfg.lr_max,
        "warmup_steps": cfg.warmup_steps,
        "total_steps": cfg.steps,
        "final_lr_ratio": cfg.final_lr_ratio,
    }
    log = json.loads((out / "train_log.json").read_text())
    assert log["step"] == list(range(1, cfg.steps + 1))
    # each update runs at the schedule's mean rate over its unit interval, so the summed rates
    # are the closed-form tau a sweep reads from schedule.json (quadrature error only)
    for k in cfg.checkpoint_steps()[1:]:
        tau = quad(lambda s: _reference_lr(s, cfg) / cfg.lr_max, 0, k, points=[cfg.warmup_steps],
                   epsabs=1e-13, epsrel=1e-13)[0]
        assert sum(log["lr"][:k]) / cfg.lr_max == pytest.approx(tau, rel=1e-10, abs=1e-12)
    last = quad(lambda s: _reference_lr(s, cfg), cfg.steps - 1, cfg.steps, epsabs=1e-15)[0]
    assert log["lr"][-1] == pytest.approx(last, rel=1e-10)


def test_quick_run_learns(quick_run):
    out, cfg = quick_run
    loss = json.loads((out / "train_log.json").read_text())["loss"]
    assert len(loss) == cfg.steps
    # a freshly initialised LM head is close to uniform over the vocabulary: loss ~ ln V
    assert loss[0] == pytest.approx(math.log(len(corpus.VOCAB)), abs=0.1)
    # it learns more than the token frequencies: below the unigram entropy of its own tokens
    counts = torch.bincount(tiny_lm.training_tokens(cfg, corpus.build_tokenizer()).flatten())
    p = counts[counts > 0].double() / counts.sum()
    unigram = float(-(p * p.log()).sum())
    assert sum(loss[-5:]) / 5 < unigram - 0.1 < loss[0] - 0.4


def test_step0_is_the_seeded_initialisation(quick_run):
    from transformers import GPTNeoXForCausalLM

    out, cfg = quick_run
    torch.manual_seed(cfg.seed)
    fresh = GPTNeoXForCausalLM(tiny_lm.model_config(cfg, corpus.build_tokenizer()))
    saved = _state(out / "step0")
    for name, tensor in fresh.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], tensor), name


def test_finished_run_is_reused_without_training(quick_run, monkeypatch):
    out, cfg = quick_run
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise AssertionError("a finished run must not be trained again")

    monkeypatch.setattr(tiny_lm, "training_tokens", boom)
    assert train_tiny_lm(out, cfg, progress=False) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert tiny_lm.is_complete(out, cfg)
    assert not tiny_lm.is_complete(out, dataclasses.replace(cfg, seed=cfg.seed + 1))


def test_other_config_is_refused_unless_overwrite(tmp_path):
    a, b = _tiny(2, save_steps=(0, 2)), _tiny(3, save_steps=(0, 3))
    train_tiny_lm(tmp_path, a, progress=False)
    with pytest.raises(TinyLMError, match="different config") as info:
        train_tiny_lm(tmp_path, b, progress=False)
    assert "\n" not in str(info.value)
    train_tiny_lm(tmp_path, b, progress=False, overwrite=True)
    assert tiny_lm.is_complete(tmp_path, b) and not tiny_lm.is_complete(tmp_path, a)


def test_interrupted_run_leaves_no_half_folder_and_reruns_identically(tmp_path, monkeypatch):
    cfg = _tiny(6, save_steps=(0, 2, 4, 6))
    real_save = tiny_lm.corpus.build_tokenizer().save_pretrained.__func__
    calls = {"n": 0}

    def crashing_save(self, folder, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the third checkpoint (step 4) dies half written
            Path(folder, "partial.bin").write_bytes(b"x")
            raise KeyboardInterrupt
        return real_save(self, folder, *args, **kwargs)

    tok_class = type(tiny_lm.corpus.build_tokenizer())
    monkeypatch.setattr(tok_class, "save_pretrained", crashing_save)
    crashed = tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        train_tiny_lm(crashed, cfg, progress=False)
    assert sorted(p.name for p in crashed.iterdir()) == ["schedule.json", "step0", "step2"]
    assert not tiny_lm.is_complete(crashed, cfg)
    monkeypatch.undo()

    train_tiny_lm(crashed, cfg, progress=False)
    clean = train_tiny_lm(tmp_path / "clean", cfg, progress=False)
    assert tiny_lm.is_complete(crashed, cfg)
    for s in (0, 2, 4, 6):
        a, b = _state(crashed / f"step{s}"), _state(clean / f"step{s}")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_on_step_sees_every_step_in_train_mode_and_retrain_repeats_the_run(tmp_path):
    cfg = _tiny(4, save_steps=(0, 4))
    calls = []

    def on_step(step, model, optimizer, scheduler):
        calls.append((step, model.training, optimizer.param_groups[0]["lr"], scheduler))

    out = train_tiny_lm(tmp_path, cfg, progress=False)
    first = _state(out / "step4")
    train_tiny_lm(tmp_path, cfg, progress=False, on_step=on_step)  # finished: not trained again
    assert calls == []
    train_tiny_lm(tmp_path, cfg, progress=False, on_step=on_step, retrain=True)
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4]
    assert all(c[1] for c in calls) and all(c[3] is None for c in calls)
    log = json.loads((out / "train_log.json").read_text())
    assert [c[2] for c in calls[1:]] == log["lr"]  # the rate each update ran at
    again = _state(out / "step4")
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_bad_configs_are_one_line_errors(tmp_path):
    for bad, pattern in [
        (dict(hidden=100, n_heads=3), "multiple of n_heads"),
        (dict(warmup_steps=10_000), "warmup_steps"),
        (dict(save_steps=(0, 5000)), "outside"),
        (dict(steps=0), "steps"),
    ]:
        with pytest.raises(TinyLMError, match=pattern):
            train_tiny_lm(tmp_path / "x", dataclasses.replace(TinyLMConfig(), **bad), progress=False)
    assert not (tmp_path / "x").exists()


def test_default_checkpoints_are_log_spaced():
    cfg = TinyLMConfig()
    steps = cfg.checkpoint_steps()
    assert steps[0] == 0 and steps[-1] == cfg.steps
    assert len(steps) == cfg.n_checkpoints
    ratios = [b / a for a, b in zip(steps[1:-1], steps[2:], strict=True)]
    ideal = cfg.steps ** (1 / (cfg.n_checkpoints - 2))
    assert all(1.0 < r < 2.0 * ideal for r in ratios)
    late = ratios[len(ratios) // 2 :]  # away from integer rounding, the spacing is geometric
    assert all(r == pytest.approx(ideal, rel=0.05) for r in late)


def test_capture_helper_reproduces_the_model(quick_run):
    """The measuring helper must compute the model's own attention (checked against sdpa)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    out, cfg = quick_run
    ids = _eval_ids(corpus.build_tokenizer(), 2, cfg.seq_len)
    head_logit_stats(out / f"step{cfg.steps}", ids)
    AttentionInterface.register(CAPTURE, _capture_attention)
    try:
        captured = AutoModelForCausalLM.from_pretrained(out / f"step{cfg.steps}", attn_implementation=CAPTURE)
        reference = AutoModelForCausalLM.from_pretrained(out / f"step{cfg.steps}", attn_implementation="sdpa")
        with torch.no_grad():
            a, b = captured(input_ids=ids).logits, reference(input_ids=ids).logits
    finally:
        AttentionInterface._global_mapping.pop(CAPTURE, None)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_default_run_has_a_peaked_head_whose_logits_grow(default_tiny_lm):
    cfg, out = TinyLMConfig(), default_tiny_lm
    ids = _eval_ids(corpus.build_tokenizer(), 8, cfg.seq_len)
    steps = cfg.checkpoint_steps()
    stds = torch.stack([head_logit_stats(out / f"step{s}", ids)[0] for s in steps])  # (C, L, H)
    _, peaked = head_logit_stats(out / f"step{cfg.steps}", ids)  # (L, H)
    t = cfg.seq_len
    mean_threshold = sum(math.sqrt(2 * math.log(n)) for n in range(2, t + 1)) / (t - 1)
    good = (peaked > 0.5) & (stds[-1] > mean_threshold)  # (L, H)
    assert good.any(), f"no peaked head: final std {stds[-1]}, peaked fraction {peaked}"
    growing = []
    for layer, head in good.nonzero().tolist():
        series = stds[:, layer, head]  # (C,)
        rho = spearmanr(steps, series.tolist()).statistic
        if rho > 0.9 and series[-1] > 10 * series[0] and series[-1] >= 0.97 * series.max():
            growing.append((layer, head))
    assert growing, f"no peaked head grows steadily: stds per checkpoint {stds}"
