"""Sweeps over a local checkpoint sequence: results equal direct probes, resume, failures,
pickle refusal, determinism, crash safety under SIGKILL, and two-process sharding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import STEPS, eval_data, write_sequence

from peakprobe import results, vocab
from peakprobe.checkpoint import probe_model
from peakprobe.checkpoints_index import from_local
from peakprobe.cli import main
from peakprobe.config import ProbeConfig
from peakprobe.corpus import build_tokenizer
from peakprobe.sweep import SweepConfig, SweepError, sweep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sequence(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seq")
    models = write_sequence(folder)
    return folder, models


CONFIG = SweepConfig(batch_size=2, prefetch=True)


def test_sweep_results_equal_direct_probes_of_each_model(sequence, tmp_path):
    folder, models = sequence
    seq = from_local(folder)
    data = eval_data()
    summary = sweep(seq, data, tmp_path / "run", CONFIG, progress=False)
    assert summary.done == [f"step{s}" for s in STEPS] and not summary.failed
    manifest = results.read_manifest(tmp_path / "run")
    assert manifest["data"]["token_hash"] == data.token_hash
    for ckpt in seq:
        got = pd.read_parquet(results.checkpoint_path(tmp_path / "run", ckpt.revision))
        direct = probe_model(models[ckpt.revision], data, CONFIG)
        assert list(got.columns) == results.RESULT_SCHEMA.names
        assert (got["step"] == ckpt.step).all() and (got["revision"] == ckpt.revision).all()
        assert got["tau"].iloc[0] == pytest.approx(ckpt.tau) and ckpt.tau > 0 or ckpt.step == 0
        np.testing.assert_allclose(got["value"], direct["value"], rtol=1e-5, atol=1e-9)
        assert got["n_rows"].tolist() == direct["n_rows"].tolist()
    # Attention sharpened along the sequence: the first head's logit std grows.
    df = results.read_results(tmp_path / "run")
    std = df[(df.metric == "logit_std") & (df.layer == 0) & (df["head"] == 0)].set_index("step")["value"]
    assert std[64] > 2 * std[0]


def test_same_inputs_give_byte_identical_files(sequence, tmp_path):
    folder, _ = sequence
    seq = from_local(folder).select(steps=[0, 8, 64])
    for name in ("a", "b"):
        sweep(seq, eval_data(), tmp_path / name, CONFIG, progress=False)
    for f in sorted((tmp_path / "a" / "checkpoints").glob("*.parquet")):
        assert f.read_bytes() == (tmp_path / "b" / "checkpoints" / f.name).read_bytes()


def test_resume_skips_done_and_refuses_a_changed_config(sequence, tmp_path):
    folder, _ = sequence
    seq = from_local(folder).select(steps=[0, 4, 16])
    run = tmp_path / "run"
    first = sweep(seq, eval_data(), run, CONFIG, progress=False)
    assert len(first.done) == 3
    mtimes = {f.name: f.stat().st_mtime_ns for f in (run / "checkpoints").glob("*.parquet")}
    again = sweep(seq, eval_data(), run, CONFIG, progress=False)
    assert again.done == [] and sorted(again.skipped) == sorted(first.done)
    assert mtimes == {f.name: f.stat().st_mtime_ns for f in (run / "checkpoints").glob("*.parquet")}
    with pytest.raises(SweepError, match="data"):
        sweep(seq, eval_data(n=2), run, CONFIG, progress=False)
    forced = sweep(seq, eval_data(n=2), run, CONFIG, force=True, progress=False)
    assert len(forced.done) == 3


def test_failed_and_pickle_checkpoints_are_recorded_and_the_sweep_goes_on(sequence, tmp_path):
    folder, models = sequence
    local = tmp_path / "seq"
    for rev in ("step0", "step4"):
        models[rev].save_pretrained(local / rev)
        build_tokenizer().save_pretrained(local / rev)
    broken = local / "step2"  # weights that are not a model
    models["step0"].save_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    pickled = local / "step3"  # an old-style checkpoint: pickle weights only
    models["step0"].save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(models["step0"].state_dict(), pickled / "pytorch_model.bin")
    build_tokenizer().save_pretrained(pickled)
    summary = sweep(from_local(local), eval_data(), tmp_path / "run", CONFIG, progress=False)
    assert sorted(summary.done) == ["step0", "step4"]
    assert sorted(summary.failed) == ["step2", "step3"]
    failures = {f["revision"]: f["error"] for f in results.read_failures(tmp_path / "run")}
    assert "--allow-pickle" in failures["step3"]
    allowed = SweepConfig(batch_size=2, allow_pickle=True, probe=ProbeConfig())
    again = sweep(from_local(local), eval_data(), tmp_path / "run2", allowed, progress=False)
    assert "step3" in again.done


def _cli_sweep(folder: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "peakprobe", "sweep", str(folder), "--out", str(out),
           "--n-windows", "24", "--window", "48", "--batch-size", "2", "-q", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigkill_mid_sweep_then_resume_gives_identical_files(sequence, tmp_path):
    folder, _ = sequence
    ref = _cli_sweep(folder, tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()
    proc = _cli_sweep(folder, tmp_path / "run")
    ckdir = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and len(list(ckdir.glob("*.parquet"))) < 3:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = sorted(ckdir.glob("*.parquet"))
    assert 3 <= len(partial) < len(STEPS)
    for f in partial:  # whatever is visible under a final name is complete
        assert f.read_bytes() == (tmp_path / "ref" / "checkpoints" / f.name).read_bytes()
    resumed = _cli_sweep(folder, tmp_path / "run")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    ref_files = sorted(p.name for p in (tmp_path / "ref" / "checkpoints").glob("*.parquet"))
    assert sorted(p.name for p in ckdir.glob("*.parquet")) == ref_files
    assert not [p for p in ckdir.iterdir() if not p.name.endswith(".parquet")]
    for name in ref_files:
        assert (ckdir / name).read_bytes() == (tmp_path / "ref" / "checkpoints" / name).read_bytes()


def _assert_same_values(one: pd.DataFrame, two: pd.DataFrame) -> None:
    """The same rows; values equal up to float32 rounding with another thread count (each
    process takes its share of the cores, so the reductions run in another order). The
    statistics stay within 1e-5; the attribution's searched gains and optima move with the loss's
    rounding noise, so they are held to 1% (or 1e-6 of a nat) instead."""
    pd.testing.assert_frame_equal(one.drop(columns="value"), two.drop(columns="value"))
    searched = one["metric"].isin(vocab.ATTRIBUTION_METRICS).to_numpy()
    np.testing.assert_allclose(two["value"][~searched], one["value"][~searched], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(two["value"][searched], one["value"][searched], rtol=1e-2, atol=1e-6)


def test_two_processes_give_the_same_result_set(sequence, tmp_path):
    folder, _ = sequence
    args = ["--n-windows", "4", "--window", "24", "--batch-size", "2", "-q"]
    assert main(["sweep", str(folder), "--out", str(tmp_path / "one"), *args]) == 0
    assert main(["sweep", str(folder), "--out", str(tmp_path / "two"), "--processes", "2", *args]) == 0
    one, two = results.read_results(tmp_path / "one"), results.read_results(tmp_path / "two")
    _assert_same_values(one, two)
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert len(manifest["checkpoints"]) == len(STEPS)


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "missing"), "--out", str(tmp_path / "r"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peakprobe: error:")
    assert main(["index", "not-a-family"]) == 2
    assert "pythia" in capsys.readouterr().err
    assert main(["sweep", "--bogus"]) == 2


def test_distributed_launch_two_cpu_processes_shard_through_accelerate(sequence, tmp_path):
    """torchrun starts two gloo processes; the sweep reads its rank from accelerate's
    PartialState and each process probes half of the checkpoints. (accelerate's own launcher
    needs MPI for several CPU processes; on GPUs `accelerate launch -m peakprobe` is the same.)"""
    folder, _ = sequence
    args = ["--n-windows", "4", "--window", "24", "--batch-size", "2"]
    assert main(["sweep", str(folder), "--out", str(tmp_path / "one"), "-q", *args]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "peakprobe", "sweep", str(folder), "--out", str(tmp_path / "two"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    per_rank = [line for line in done.stdout.splitlines() if "checkpoints probed" in line]
    assert len(per_rank) == 2 and all(line.startswith("4 checkpoints probed") for line in per_rank)
    one, two = results.read_results(tmp_path / "one"), results.read_results(tmp_path / "two")
    _assert_same_values(one, two)
