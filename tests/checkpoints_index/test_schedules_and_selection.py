"""Schedules in every accepted form (and malformed ones), the published OLMo / Amber schedules
against a numerical integral, the default Pythia selection, PolyPythia names, and duplicate
detection on planted weight hashes. No weights, no network."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.integrate import quad

from peakprobe.checkpoints_index import (
    ACCEPTED_FORMS,
    PYTHIA_AUTHOR_STEPS,
    ScheduleError,
    TableSchedule,
    WarmupCosine,
    WarmupLinear,
    find_duplicates,
    from_local,
    published_run,
    pythia,
    read_schedule_file,
    resolve,
    sequence_from_branches,
)
from peakprobe.checkpoints_index.published import AMBER, OLMO1_7B, OLMO2_7B, OLMO2_13B


def olmo_cosine_lr(tokens: float, lr: float, warmup: float, t_max: float, alpha_f: float) -> float:
    """OLMo's cosine_with_warmup as its trainer computes it (units: tokens, warmup_min_lr 0)."""
    eta_min = lr * alpha_f
    if tokens < warmup:
        return lr * tokens / warmup
    if tokens >= t_max:
        return eta_min
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * (tokens - warmup) / (t_max - warmup))) / 2


@pytest.mark.parametrize("repo,run,batch", [
    ("allenai/OLMo-2-1124-7B", OLMO2_7B, 1024 * 4096),
    ("allenai/OLMo-2-1124-13B", OLMO2_13B, 2048 * 4096),
])
def test_olmo2_tau_matches_quad_of_the_published_schedule(repo, run, batch):
    assert published_run(repo) is run and run.tokens_per_step == batch
    for step in (500, 1000, 2000, 150_000, 596_057, 928_646, 1_300_000):
        def lr_at(s):
            return olmo_cosine_lr(s * batch, 3e-4, 8_388_608_000, 5e12, 0.1)

        breaks = [b / batch for b in (8_388_608_000, 5e12) if b / batch < step]
        ref = quad(lr_at, 0, step, points=breaks or None, limit=500, epsabs=1e-10, epsrel=1e-12)[0] / 3e-4
        assert run.schedule.tau(step) == pytest.approx(ref, rel=1e-6, abs=1e-6)
    seq = sequence_from_branches(repo, ["stage1-step1000-tokens5B", "stage1-step140000-tokens588B"])
    assert seq.schedule is run.schedule
    assert seq.by_step(140000).tau == pytest.approx(run.schedule.tau(140000))


def test_linear_and_amber_schedules_against_quad():
    for step in (100, 5000, 200_000, 476_837, 600_000):
        ref = quad(lambda s: float(OLMO1_7B.schedule.lr(s)), 0, step, points=[5000, 476_837.158],
                   limit=500)[0] / 3e-4
        assert OLMO1_7B.schedule.tau(step) == pytest.approx(ref, rel=1e-7)
    wl = WarmupLinear(1.0, 10, 110, 0.2)
    assert wl.lr(60) == pytest.approx(0.6) and wl.lr(200) == pytest.approx(0.2)
    # Amber in chunks: warmup 8000 of 3048 micro-steps per chunk, 360 chunks, 3e-4 -> 3e-5
    seq = sequence_from_branches("LLM360/Amber", ["ckpt_000", "ckpt_179", "ckpt_358", "main"])
    for c in seq:
        ref = quad(lambda u: olmo_cosine_lr(u, 3e-4, 8000 / 3048, 360, 0.1), 0, c.step + 1,
                   points=[8000 / 3048], limit=200)[0] / 3e-4
        assert c.tau == pytest.approx(ref, rel=1e-7)
    assert AMBER.schedule.lr(360) == pytest.approx(3e-5)


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# (file name, content, lr at step 2, tau at step 3 (lr_max = max lr))
GOOD = [
    ("per_step.json", {"lr": [0.0, 1.0, 2.0, 2.0]}, 2.0, (0.5 + 1.5 + 2.0) / 2.0),
    ("bare.json", [0.0, 1.0, 2.0, 2.0], 2.0, 2.0),
    ("table.json", {"steps": [0, 2, 4], "lr": [0.0, 2.0, 2.0]}, 2.0, (2.0 + 2.0) / 2.0),
    ("kind_table.json", {"kind": "table", "steps": [0, 2], "lr": [0.0, 2.0], "lr_max": 4.0}, 2.0, 1.0),
    ("cosine.json", {"kind": "warmup_cosine", "lr_max": 1.0, "warmup_steps": 2, "total_steps": 4,
                     "final_lr_ratio": 0.0}, 1.0, None),
    ("linear.json", {"kind": "warmup_linear", "lr_max": 1.0, "warmup_steps": 2, "total_steps": 4,
                     "final_lr_ratio": 0.0}, 1.0, 1.0 + 0.75),
    ("plain.csv", "step,lr\n0,0\n1,1\n2,2\n3,2\n", 2.0, 2.0),
    ("wandb.csv", "Step,_step,train/learning_rate,train/learning_rate__MIN,train/loss\n"
                  "0,0,0.0,0.0,9\n1,1,,,8\n2,2,2.0,2.0,7\n3,3,2.0,2.0,6\n", 2.0, 2.0),
    ("trainer_state.json", {"log_history": [{"step": 0, "learning_rate": 0.0},
                                            {"step": 2, "learning_rate": 2.0, "loss": 3.0},
                                            {"step": 2, "eval_loss": 3.1},
                                            {"step": 4, "learning_rate": 2.0}]}, 2.0, 2.0),
]


@pytest.mark.parametrize("name,content,lr2,tau3", GOOD, ids=[g[0] for g in GOOD])
def test_every_schedule_form(tmp_path, name, content, lr2, tau3):
    schedule = read_schedule_file(_write(tmp_path, name, content))
    assert schedule.lr(2) == pytest.approx(lr2)
    if tau3 is not None:
        assert schedule.tau(3) == pytest.approx(tau3)
    steps = np.linspace(0, 4, 4001)  # tau is the integral of lr / lr_max
    numeric = np.trapezoid(np.asarray(schedule.lr(steps)), steps) / schedule.lr_max
    assert schedule.tau(4) == pytest.approx(numeric, rel=1e-4, abs=1e-6)


BAD = [
    ("empty_list.json", []),
    ("lr_not_list.json", {"lr": 3}),
    ("strings.json", {"lr": ["a", "b"]}),
    ("unknown_keys.json", {"rate": [1, 2]}),
    ("bad_kind.json", {"kind": "exponential", "lr_max": 1}),
    ("missing.json", {"kind": "warmup_cosine", "lr_max": 1}),
    ("negative.json", {"lr": [1.0, -1.0]}),
    ("not_json.json", "{lr: [1, 2"),
    ("scalar.json", 3),
    ("no_lr_column.csv", "step,loss\n0,1\n"),
    ("no_step_column.csv", "lr\n0.1\n"),
    ("text.csv", "step,lr\n0,abc\n"),
    ("empty.csv", ""),
    ("no_lr_state.json", {"log_history": [{"step": 1, "loss": 2.0}]}),
]


@pytest.mark.parametrize("name,content", BAD, ids=[b[0] for b in BAD])
def test_malformed_schedules_are_one_line_errors_showing_the_accepted_forms(tmp_path, name, content):
    with pytest.raises(ScheduleError) as info:
        read_schedule_file(_write(tmp_path, name, content))
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value, ValueError)
    assert ACCEPTED_FORMS in msg and name in msg


def test_local_run_reads_a_plain_per_step_list_and_a_csv(tmp_path):
    for step in (2, 4):
        (tmp_path / f"step{step}").mkdir()
        (tmp_path / f"step{step}" / "config.json").write_text("{}")
    _write(tmp_path, "schedule.json", {"lr": [0.5] * 10})
    assert [c.tau for c in from_local(tmp_path)] == [2.0, 4.0]
    (tmp_path / "schedule.json").unlink()
    _write(tmp_path, "schedule.csv", "_step,train/lr\n0,1\n10,1\n")
    assert [c.tau for c in from_local(tmp_path)] == [2.0, 4.0]
    _write(tmp_path, "schedule.json", {"lr": "x"})
    with pytest.raises(ScheduleError, match="accepted schedule forms"):
        from_local(tmp_path)


def test_default_pythia_selection_keeps_ten_checkpoints_in_the_fit_window():
    from peakprobe.checkpoints_index import select_available

    for name, start in (("pythia-160m", 512), ("pythia-70m", 256), ("pythia-70m-deduped", 256),
                        ("pythia-1.4b", 512)):
        full = resolve(name)
        assert full.fit_start_step == start
        seq, note = select_available(full, full, where="on the hub")
        assert note is None and len(seq) >= 16
        assert set(PYTHIA_AUTHOR_STEPS) <= set(seq.steps)
        assert sum(s >= start for s in seq.steps) >= 10
    # with only some revisions cached, the default picks among them
    few = pythia("160m", steps=(0, 1, 2, 4, 512, 1000, 9000, 143000))
    seq, _ = select_available(resolve("pythia-160m"), few, where="in the HF cache")
    assert seq.steps == [1, 2, 4, 512, 1000, 9000, 143000]  # step0 is not on a log axis


def test_polypythia_names_are_pythia():
    seq = resolve("EleutherAI/pythia-160m-seed3")
    assert seq.family == "pythia" and seq.name == "pythia-160m-seed3"
    assert seq.source == "EleutherAI/pythia-160m-seed3" and len(seq) == 154
    assert seq.by_step(1000).tau == pytest.approx(pythia("160m").by_step(1000).tau)
    branches = sequence_from_branches("EleutherAI/pythia-410m-seed1", ["step0", "step1000", "main"])
    assert branches.family == "pythia" and branches.schedule == pythia("410m").schedule


def test_find_duplicates_rule_whole_and_partial():
    steps = {"step0": 0, "step1000": 1000, "step2000": 2000, "step50000": 50000, "step143000": 143000}
    hashes = {
        "step0": {"model.safetensors": "F"},        # the final model, whole
        "step1000": {"model.safetensors": "a"},
        "step2000": {"model.safetensors": "a"},     # identical to step1000
        "step50000": {"model-1.safetensors": "F1", "model-2.safetensors": "x"},  # first shard of main
        "step143000": {"model.safetensors": "F"},
    }
    got = find_duplicates(hashes, steps, final_step=143000, main={"model-1.safetensors": "F1"})
    assert got == {
        "step0": {"step": 0, "duplicates": ["step143000"], "files": ["model.safetensors"], "whole": True},
        "step1000": {"step": 1000, "duplicates": ["step2000"], "files": ["model.safetensors"], "whole": True},
        "step50000": {"step": 50000, "duplicates": ["main"], "files": ["model-1.safetensors"], "whole": False},
    }
    # no final step known: the highest step keeps the file
    got = find_duplicates({"a": {"w": "h"}, "b": {"w": "h"}, "c": {"w": "h"}}, {"a": 1, "b": 2, "c": 3})
    assert sorted(got) == ["a", "b"] and got["a"]["duplicates"] == ["b", "c"]


def test_table_schedule_lr_max_from_user():
    t = TableSchedule([0, 10], [1.0, 1.0], lr_max=2.0)
    assert t.tau(10) == pytest.approx(5.0)
    assert isinstance(read_schedule_file, object) and WarmupCosine(1, 0, 1).tau(1) == pytest.approx(0.55)
