"""The framework-free Monitor: planned steps, state restoration, tau, the same numbers as an
independent probe, summary scalars and alarms, and the run directory it writes."""

from __future__ import annotations

import copy
import logging
import random

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import tiny_model
from helpers.trainer_run import eval_windows, tiny_neox, windows

from peakprobe import results, vocab
from peakprobe.checkpoint import probe_model
from peakprobe.integrations import (
    Monitor,
    MonitorError,
    alarms,
    attribution_steps,
    live_config,
    live_scalars,
    planned_steps,
    training_state_preserved,
)

STEPS = 12


pytestmark = pytest.mark.usefixtures("one_thread")


# -- planned steps ------------------------------------------------------------------------------
def test_default_cadence_is_forty_distinct_log_spaced_steps():
    steps = planned_steps(800)
    assert len(steps) == vocab.MONITOR_POINTS and steps[0] == 0 and steps[-1] == 800
    assert len(set(steps)) == len(steps)
    late = np.diff(np.log(steps[len(steps) // 2:]))  # away from rounding: geometric spacing
    assert late.max() < 1.3 * late.min()
    after_warmup = planned_steps(800, start=20)
    assert after_warmup[1] == 20 and len(after_warmup) == vocab.MONITOR_POINTS
    assert set(range(0, 801, 100)) <= set(planned_steps(800, every=100))
    assert planned_steps(5) == [0, 1, 2, 3, 4, 5]  # short runs: every step
    assert 7 in planned_steps(800, steps=[7])
    for bad in (dict(total_steps=0), dict(total_steps=10, every=0), dict(total_steps=10, steps=[11])):
        with pytest.raises(MonitorError):
            planned_steps(**bad)


def test_attribution_runs_at_a_log_spaced_subset_that_ends_with_the_last_step():
    planned = planned_steps(800, start=20)
    chosen = attribution_steps(planned, vocab.MONITOR_ATTRIBUTION_POINTS, start=20)
    assert len(chosen) == vocab.MONITOR_ATTRIBUTION_POINTS and set(chosen) <= set(planned)
    assert chosen[0] == 20 and chosen[-1] == 800 and 0 not in chosen
    even = np.log(800 / 20) / (len(chosen) - 1)  # log-spaced, within the planned steps' rounding
    ratios = np.diff(np.log(chosen))
    assert ratios.min() > 0.25 * even and ratios.max() < 2 * even
    assert attribution_steps(planned, None) == planned
    assert attribution_steps(planned, 1, start=20) == [800]
    assert attribution_steps([0, 5, 10], 10) == [5, 10]
    with pytest.raises(MonitorError):
        attribution_steps(planned, 0)


# -- state restoration --------------------------------------------------------------------------
def test_state_is_restored_even_when_the_block_draws_random_numbers_and_raises():
    model = tiny_neox()
    model.train()
    model.gpt_neox.emb_dropout.eval()  # one submodule deliberately in eval
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with pytest.raises(RuntimeError):
        with training_state_preserved(model):
            assert not model.training and not model.gpt_neox.layers[0].training
            random.random(), np.random.rand(3), torch.rand(3)
            model.train()
            raise RuntimeError("probe failed")
    after = (random.random(), np.random.rand(3), torch.rand(3))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert after[0] == random.random()
    assert np.array_equal(after[1], np.random.rand(3)) and torch.equal(after[2], torch.rand(3))
    assert model.training and model.gpt_neox.layers[0].training
    assert not model.gpt_neox.emb_dropout.training


# -- a plain training loop ------------------------------------------------------------------------
def _lambda(i: int) -> float:
    """Warmup over 4 updates, then linear decay to 0.2 at STEPS: the scheduler's factor."""
    return (i + 1) / 4 if i < 3 else 1.0 - 0.8 * (i - 3) / (STEPS - 3)


def _loop(monitor: Monitor | None, snapshots: dict | None = None):
    """STEPS updates of the dropout model; the per-step losses and the final RNG draw."""
    model = tiny_neox(dropout=0.2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    data = windows(2 * STEPS, seed=3)  # (24, T): training batches of 2
    if monitor is not None:
        monitor.watch(model, opt, sched)
        monitor.step(0)
    if snapshots is not None:
        snapshots[0] = copy.deepcopy(model)
    losses = []
    for step in range(1, STEPS + 1):
        batch = data[2 * step - 2: 2 * step]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if monitor is not None:
            monitor.step(step)
        if snapshots is not None:
            snapshots[step] = copy.deepcopy(model)
    assert model.training
    return losses, torch.rand(4)


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory):
    run = tmp_path_factory.mktemp("plain") / "run"
    logged: dict[int, dict] = {}
    torch.manual_seed(5)
    monitor = Monitor(eval_windows(), run, total_steps=STEPS, n_points=6, every=4,
                      log=lambda scalars, step: logged.setdefault(step, scalars))
    with monitor:
        live = _loop(monitor)
    snapshots: dict = {}
    torch.manual_seed(5)
    reference = _loop(None, snapshots)
    return run, monitor, logged, live, reference, snapshots


def test_plain_loop_training_is_unchanged(plain_loop):
    _, monitor, _, (losses, draw), (ref_losses, ref_draw), _ = plain_loop
    assert len(monitor.done) == len(monitor.planned) >= 8
    assert losses == ref_losses  # dropout 0.2 draws from the RNG at every step
    assert torch.equal(draw, ref_draw)


def test_plain_loop_numbers_equal_an_independent_probe_and_tau_sums_the_scheduler(plain_loop):
    run, monitor, _, _, _, snapshots = plain_loop
    df = results.read_results(run)
    assert sorted(df.step.unique()) == monitor.planned
    assert 0 not in monitor.attribution_steps and STEPS in monitor.attribution_steps
    for step in monitor.planned:  # the Monitor's default config, the attribution where planned
        config = live_config(attribution=step in monitor.attribution_steps)
        frame = probe_model(snapshots[step].eval(), eval_windows(), config)
        live = df[df.step == step].reset_index(drop=True)
        cols = ["site_kind", "layer", "head", "metric", "value", "n_rows"]
        pd.testing.assert_frame_equal(live[cols], frame[cols], check_exact=True)
        tau = sum(_lambda(i) for i in range(step))  # update i+1 runs at lr_max * lambda(i)
        assert live["tau"].iloc[0] == pytest.approx(tau, rel=1e-12, abs=0)
    manifest = results.read_manifest(run)
    assert [c["step"] for c in manifest["checkpoints"]] == monitor.planned
    assert manifest["attribution"]["steps"] == monitor.attribution_steps
    assert manifest["attribution"]["windows"] == vocab.MONITOR_ATTRIBUTION_WINDOWS
    gained = sorted(df[df.metric == vocab.GAIN].step.unique())
    assert gained == monitor.attribution_steps
    assert monitor.lr_max == 1e-2 and monitor.lr_max_source == "scheduler base lr"


def test_plain_loop_logs_the_live_scalars(plain_loop):
    run, monitor, logged, _, _, _ = plain_loop
    assert sorted(logged) == monitor.planned
    df = results.read_results(run)
    last = df[df.step == STEPS]
    scalars = logged[STEPS]
    assert scalars["peakprobe/loss"] == last[last.metric == "loss"]["value"].item()
    std = last[(last.site_kind == "attn") & (last.metric == "logit_std")]
    assert scalars["peakprobe/L1/logit_std_median"] == std[std.layer == 1]["value"].median()
    assert sum(k.startswith("peakprobe/top/") for k in scalars) == vocab.MONITOR_TOP_HEADS
    assert scalars["peakprobe/tau"] == df[df.step == STEPS]["tau"].iloc[0]


def test_fit_runs_on_a_run_still_in_progress(plain_loop, tmp_path):
    """Half of the planned probes written: the run directory is already a valid input."""
    import shutil

    from peakprobe.fits import fit_run

    run, monitor, _, _, _, _ = plain_loop
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    for step in monitor.planned[len(monitor.planned) // 2 + 2:]:
        results.checkpoint_path(partial, f"step{step}").unlink()
    fits = fit_run(partial, progress=False)
    assert fits is not None and (partial / results.FITS).exists()


# -- run directory --------------------------------------------------------------------------------
def test_other_rank_writes_nothing_and_another_runs_folder_is_refused(tmp_path):
    model = tiny_model("gpt_neox", dtype=torch.float32)
    quiet = Monitor(eval_windows(), tmp_path / "r1", total_steps=4, model=model, rank=1)
    assert quiet.step(0) is None and quiet.probe(4) is None
    assert not (tmp_path / "r1").exists()
    first = Monitor(eval_windows(), tmp_path / "run", total_steps=4, model=model, lr_max=1.0)
    first.step(0)
    again = Monitor(eval_windows(), tmp_path / "run", total_steps=4, model=model, lr_max=1.0)
    again.step(0)  # the same run may continue (a restart of the same training)
    other = Monitor(eval_windows(3), tmp_path / "run", total_steps=4, model=model)
    with pytest.raises(MonitorError, match="another run"):
        other.step(0)
    Monitor(eval_windows(3), tmp_path / "run", total_steps=4, model=model, force=True).step(0)
    with pytest.raises(MonitorError, match="watch"):
        Monitor(eval_windows(), tmp_path / "x", total_steps=4).probe(0)


def test_a_logit_std_jump_raises_a_warning_that_names_the_head(tmp_path, caplog):
    model = tiny_model("gpt_neox", dtype=torch.float32)
    monitor = Monitor(eval_windows(), tmp_path / "run", total_steps=2, model=model)

    def sharpen_layer_1():
        with torch.no_grad():  # queries and keys x2 (zero bias): the layer's logits x4
            model.gpt_neox.layers[1].attention.query_key_value.weight.mul_(2.0)

    with caplog.at_level(logging.WARNING, logger="peakprobe.monitor"):
        monitor.step(0)
        sharpen_layer_1()
        monitor.step(1)  # growth away from the initialisation is not an anomaly
        assert not [r for r in caplog.records if "jump" in r.getMessage()]
        sharpen_layer_1()
        monitor.step(2)
    jumps = [r.getMessage() for r in caplog.records if "logit-std jump at step 2" in r.getMessage()]
    assert len(jumps) == 4 and all("attn L1 H" in m and "since step 1" in m for m in jumps)
    assert not any("attn L0" in m for m in jumps)
    assert results.read_json(tmp_path / "run" / vocab.MONITOR_FILE)["alarms"] == monitor.alarms


def test_a_head_whose_logits_cross_the_max_logit_threshold_is_named(tmp_path, caplog):
    """One head's queries scaled until its largest logit passes 100: the alarm names that head
    (and no other) with the value the parquet holds; a higher threshold stays silent."""
    model = tiny_model("llama_gqa", dtype=torch.float32)
    d = model.config.head_dim
    monitor = Monitor(eval_windows(), tmp_path / "run", total_steps=2, model=model)
    with caplog.at_level(logging.WARNING, logger="peakprobe.monitor"):
        first = monitor.step(0)
        top = first[(first["metric"] == vocab.LOGIT_MAX) & (first["site_kind"] == "attn")]
        assert top["value"].max() < vocab.LOGIT_MAX_ALARM
        (head_max,) = top[(top["layer"] == 0) & (top["head"] == 1)]["value"]
        with torch.no_grad():  # head 1's logits scale with its query rows
            model.model.layers[0].self_attn.q_proj.weight[d : 2 * d].mul_(1.5 * vocab.LOGIT_MAX_ALARM / head_max)
        second = monitor.step(1)
    said = [r.getMessage() for r in caplog.records if "max logit" in r.getMessage()]
    (value,) = second[(second["metric"] == vocab.LOGIT_MAX) & (second["layer"] == 0)
                      & (second["head"] == 1) & (second["site_kind"] == "attn")]["value"]
    assert value == pytest.approx(1.5 * vocab.LOGIT_MAX_ALARM, rel=0.05)
    assert len(said) == 1 and "max logit at step 1: attn L0 H1 logit_max" in said[0]
    assert f"{value:.4g} > 100" in said[0]
    assert live_scalars(second)["peakprobe/logit_max"] == pytest.approx(value)
    quiet = Monitor(eval_windows(), tmp_path / "quiet", total_steps=2, model=model,
                    logit_max_alarm=1e9)
    quiet.step(0)
    assert not [m for m in quiet.alarms if "max logit" in m]


# -- scalars and alarms on planted frames --------------------------------------------------------------
def _frame(step: int, std: dict, entropy_norm: dict, peaked: dict | None = None) -> pd.DataFrame:
    rows = [("lm_head", -1, -1, "loss", 2.0), ("lm_head", -1, -1, "logit_std", std.get("lm", 1.0)),
            ("lm_head", -1, -1, "entropy", 1.5)]
    for key, value in std.items():
        if key == "lm":
            continue
        layer, head = key
        rows += [("attn", layer, head, "logit_std", value),
                 ("attn", layer, head, "entropy", 2.0 * entropy_norm[key]),
                 ("attn", layer, head, "entropy_norm", entropy_norm[key]),
                 ("attn", layer, head, "peaked", (peaked or {}).get(key, 0.0))]
    df = pd.DataFrame(rows, columns=["site_kind", "layer", "head", "metric", "value"])
    df.insert(0, "step", step)
    return df


def test_live_scalars_of_a_planted_frame():
    std = {(0, 0): 1.0, (0, 1): 3.0, (0, 2): 2.0, (1, 0): 5.0, (1, 1): 4.0, "lm": 7.0}
    ent = {k: 0.5 for k in std if k != "lm"}
    out = live_scalars(_frame(3, std, ent, peaked={(0, 0): 0.9}), top_k=2)
    assert out["peakprobe/loss"] == 2.0 and out["peakprobe/lm_head/logit_std"] == 7.0
    assert out["peakprobe/L0/logit_std_median"] == 2.0 and out["peakprobe/L1/logit_std_median"] == 4.5
    assert out["peakprobe/L0/entropy_median"] == 1.0
    assert out["peakprobe/n_peaked_heads"] == 1.0
    tops = [k for k in out if k.startswith("peakprobe/top/")]
    assert tops == ["peakprobe/top/L0H0/logit_std", "peakprobe/top/L1H0/logit_std"]  # peaked first
    assert "peakprobe/n_peaked_heads_logit_std" not in out  # one rule measured: no secondary


def test_live_scalars_headline_the_entropy_rule_and_keep_the_logit_std_count_secondary():
    std = {(0, 0): 1.0, (0, 1): 3.0, (0, 2): 2.0, "lm": 7.0}
    frame = _frame(3, std, {k: 0.5 for k in std if k != "lm"}, peaked={(0, 2): 0.9})
    entropy_rule = pd.DataFrame({"step": 3, "site_kind": "attn", "layer": 0, "head": [0, 1, 2],
                                 "metric": vocab.PEAKED_ENTROPY, "value": [0.8, 0.6, 0.1]})
    out = live_scalars(pd.concat([frame, entropy_rule], ignore_index=True), top_k=2)
    assert out["peakprobe/n_peaked_heads"] == 2.0  # heads 0 and 1 by beta_eff
    assert out["peakprobe/n_peaked_heads_logit_std"] == 1.0  # head 2 by its logit std
    tops = [k for k in out if k.startswith("peakprobe/top/")]
    assert tops == ["peakprobe/top/L0H1/logit_std", "peakprobe/top/L0H0/logit_std"]


def test_alarms_fire_on_crossing_the_documented_thresholds_only():
    heads = [(0, 0), (0, 1)]
    a = _frame(10, {h: 1.0 for h in heads}, {h: 0.5 for h in heads})
    jump = vocab.LOGIT_STD_JUMP
    b = _frame(20, {(0, 0): 1.01 * jump, (0, 1): 0.99 * jump, "lm": 1.0},
               {(0, 0): 0.5, (0, 1): 0.9 * vocab.ENTROPY_COLLAPSE})
    found = alarms(a, b)
    assert len(found) == 2
    assert found[0].startswith("attention-entropy collapse at step 20: attn L0 H1")
    assert found[1].startswith("logit-std jump at step 20: attn L0 H0") and "since step 10" in found[1]
    still_collapsed = _frame(30, {(0, 0): 2.03, (0, 1): 1.98}, {(0, 0): 0.5, (0, 1): 0.01})
    assert alarms(b, still_collapsed) == []  # a head already collapsed is not named again
    assert alarms(None, b) == [found[0]]  # first probe: collapse only, nothing to jump from
    assert alarms(a, b, jumps=False) == [found[0]]
