"""The HF Trainer callback: a tiny GPT-NeoX trained 60 steps by the Trainer on CPU.

Checks, each against an independent reference: the run directory holds the planned steps and
`peakprobe fit` / `report` run on it; TensorBoard receives the scalars; the callback's numbers
at step N are a sweep's of the checkpoint the Trainer saved at N, bit for bit; tau is the sum
of the HF linear schedule's rates written out by hand; the loss trajectory (dropout 0.1) is the
one without the callback; two gloo processes probe once, on rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers.trainer_run import SAVE_EVERY, STEPS, eval_windows, train

from peakprobe import results
from peakprobe.checkpoints_index import from_local
from peakprobe.cli import main
from peakprobe.integrations import live_config, planned_steps
from peakprobe.sweep import sweep

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
WARMUP = 5  # trainer_run.train's warmup_steps


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    old = os.environ.get("TENSORBOARD_LOGGING_DIR")
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tb")
    try:
        report_to = ("tensorboard",) if HAVE_TENSORBOARD else ()
        with_cb = train(out / "with", callback=True, report_to=report_to)
        without = train(out / "without", callback=False, save=False)
    finally:
        if old is None:
            os.environ.pop("TENSORBOARD_LOGGING_DIR", None)
        else:
            os.environ["TENSORBOARD_LOGGING_DIR"] = old
    return out, with_cb, without


def _planned() -> list[int]:
    return planned_steps(STEPS, 8, start=WARMUP, every=SAVE_EVERY)


def test_run_directory_holds_the_planned_steps_and_fit_and_report_run(runs, capsys):
    out, (trainer, cb), _ = runs
    run = out / "with" / "run"
    assert cb.monitor.planned == _planned() and 0 in _planned() and STEPS in _planned()
    done = sorted(int(p.stem.removeprefix("step")) for p in (run / "checkpoints").glob("*.parquet"))
    assert done == _planned()
    manifest = results.read_manifest(run)
    assert [c["step"] for c in manifest["checkpoints"]] == _planned()
    assert manifest["source"] == str((out / "with" / "trainer").resolve())
    monitor = json.loads((run / "monitor.json").read_text())
    assert len(monitor["lr"]) == STEPS and monitor["lr_max"] == 3e-3
    assert main(["fit", str(run), "-q"]) == 0
    assert main(["report", str(run), "-q"]) == 0
    assert (run / "report" / "report.html").exists()
    # the scalars went through the Trainer's log: they are in its log history too
    logged = [e for e in trainer.state.log_history if "peakprobe/loss" in e]
    assert [e["step"] for e in logged] == _planned()


def test_tensorboard_event_file_holds_the_scalars(runs):
    if not HAVE_TENSORBOARD:
        pytest.skip("tensorboard is not installed (pip install tensorboard): the Trainer writes no event file")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = runs
    files = list((out / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(files[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("peakprobe/loss", "peakprobe/lm_head/logit_std", "peakprobe/L0/logit_std_median",
                "peakprobe/L1/entropy_median", "peakprobe/tau"):
        assert f"train/{tag}" in tags  # the Trainer's TensorBoard callback prefixes train/
    assert any(t.startswith("train/peakprobe/top/L") for t in tags)
    loss = {e.step: e.value for e in events.Scalars("train/peakprobe/loss")}
    assert sorted(loss) == _planned()
    df = results.read_results(out / "with" / "run")
    want = df[(df.metric == "loss") & (df.site_kind == "lm_head")].set_index("step")["value"]
    for step, value in loss.items():
        assert value == pytest.approx(want[step], rel=1e-6)  # TensorBoard stores float32


def _hf_linear_tau(n: int, lr_max: float = 3e-3) -> float:
    """tau(n) for HF's linear schedule, written out: update i (1-based) uses lr(i - 1)."""
    total = 0.0
    for i in range(n):
        frac = i / WARMUP if i < WARMUP else max(0.0, (STEPS - i) / (STEPS - WARMUP))
        total += lr_max * frac
    return total / lr_max


def test_callback_numbers_equal_a_sweep_of_the_saved_checkpoints(runs, tmp_path):
    out, _, _ = runs
    seq = from_local(out / "with" / "trainer")
    assert seq.steps == [SAVE_EVERY, 2 * SAVE_EVERY, STEPS]
    # the callback's default settings (live_config); the saved steps all run the attribution
    attributed = results.read_manifest(out / "with" / "run")["attribution"]["steps"]
    assert set(seq.steps) <= set(attributed)
    sweep(seq, eval_windows(), tmp_path / "swept", live_config(), progress=False)
    live, swept = results.read_results(out / "with" / "run"), results.read_results(tmp_path / "swept")
    same = ["step", "site_kind", "layer", "head", "metric", "value", "n_rows"]
    for step in seq.steps:
        a = live[live.step == step].reset_index(drop=True)
        b = swept[swept.step == step].reset_index(drop=True)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a[same], b[same], check_exact=True)  # bit for bit
        assert a["tau"].iloc[0] == pytest.approx(_hf_linear_tau(step), rel=1e-12)
    assert live[live.step == 0]["tau"].iloc[0] == 0.0


def test_training_is_unchanged_by_the_callback(runs):
    out, (with_trainer, _), (without_trainer, _) = runs

    def losses(trainer):
        return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]

    a, b = losses(with_trainer), losses(without_trainer)
    assert len(a) == STEPS and a == b  # dropout 0.1: any RNG drawn by a probe would show
    assert with_trainer.model.training == without_trainer.model.training
    wa, wb = with_trainer.model.state_dict(), without_trainer.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # two processes each load transformers and the Trainer: ~1.5 min on 2 busy cores
def test_two_gloo_processes_merge_on_rank_zero(tmp_path):
    """torchrun starts two CPU processes (gloo DDP through the Trainer's accelerate); both
    ranks probe their share of the windows at every planned step, rank 0 alone writes them
    (rank 1 records none), and the merged numbers are a sweep's of the model saved at the last
    step, bit for bit."""
    script = Path(__file__).parents[1] / "helpers" / "trainer_run.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
           str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    planned = planned_steps(STEPS, 8, start=WARMUP, every=SAVE_EVERY)
    assert lines == [f"rank 0 of 2: {len(planned)} probes", "rank 1 of 2: 0 probes"]
    run = tmp_path / "run"
    assert sorted(int(p.stem[4:]) for p in (run / "checkpoints").glob("*.parquet")) == planned
    assert not list(run.glob("failures.jsonl"))
    seq = from_local(tmp_path / "trainer").select(steps=[STEPS])
    sweep(seq, eval_windows(), tmp_path / "swept", live_config(), progress=False)
    live = pd.read_parquet(results.checkpoint_path(run, f"step{STEPS}"))
    swept = results.read_results(tmp_path / "swept")
    same = ["site_kind", "layer", "head", "metric", "value", "n_rows"]
    pd.testing.assert_frame_equal(live[same], swept[same].reset_index(drop=True), check_exact=True)
