"""Scale-out and robustness of the sweep: --shard K/N, per-checkpoint locks shared by concurrent
sweeps, a failed checkpoint that later succeeds, models freed before the cleanup runs, and the
new one-line errors (exit 2, nothing already written lost)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref
from pathlib import Path

import pytest
from helpers import STEPS, embedded_text, eval_data, write_sequence

import peakprobe.sweep as sweep_mod
from peakprobe import results
from peakprobe.checkpoints_index import from_local
from peakprobe.cli import main
from peakprobe.config import AttributionConfig
from peakprobe.sweep import SweepConfig, sweep

CONFIG = SweepConfig(batch_size=2, attribution=AttributionConfig(enabled=False))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seq")
    write_sequence(root)
    return root


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    summary = sweep(from_local(folder), eval_data(), run, CONFIG, progress=False)
    assert len(summary.done) == len(STEPS)
    return run


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "checkpoints").iterdir())}


def test_shards_together_equal_one_process_byte_for_byte(folder, reference, tmp_path):
    seq = from_local(folder)
    run = tmp_path / "run"
    first = sweep(seq, eval_data(), run, CONFIG, shard=(0, 2), progress=False)
    second = sweep(seq, eval_data(), run, CONFIG, shard=(1, 2), progress=False)
    assert first.done == seq.revisions[0::2] and second.done == seq.revisions[1::2]
    assert _files(run) == _files(reference)
    assert (run / "integrity.json").read_bytes() == (reference / "integrity.json").read_bytes()
    assert results.read_manifest(run)["checkpoints"] == results.read_manifest(reference)["checkpoints"]


def test_a_checkpoint_locked_by_another_process_is_left_to_it(folder, reference, tmp_path):
    seq = from_local(folder)
    run = tmp_path / "run"
    other = sweep_mod._lock(run, "step4")  # what another sweep on this run directory holds
    other.acquire()
    try:
        summary = sweep(seq, eval_data(), run, CONFIG, progress=False)
    finally:
        other.release()
    assert summary.busy == ["step4"] and "step4" not in summary.done
    assert not results.checkpoint_path(run, "step4").exists()
    again = sweep(seq, eval_data(), run, CONFIG, progress=False)
    assert again.done == ["step4"] and len(again.skipped) == len(STEPS) - 1
    assert _files(run) == _files(reference)


def test_two_concurrent_sweeps_never_probe_a_checkpoint_twice(folder, reference, tmp_path, monkeypatch):
    real_load = sweep_mod.load_model

    def slow_load(*args, **kwargs):  # make the two sweeps overlap
        time.sleep(0.2)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "load_model", slow_load)
    seq, run, out = from_local(folder), tmp_path / "run", {}

    def one(name):
        out[name] = sweep(seq, eval_data(), run, CONFIG, progress=False)

    threads = [threading.Thread(target=one, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    a, b = out["a"], out["b"]
    assert not set(a.done) & set(b.done)
    assert sorted(a.done + b.done) == sorted(seq.revisions)
    assert _files(run) == _files(reference)


_SWEEP_PROCESS = """
import json, sys, time
sys.path.insert(0, {tests!r})
from helpers import eval_data
import peakprobe.sweep as sweep_mod
from peakprobe.checkpoints_index import from_local
from peakprobe.config import AttributionConfig

real_load = sweep_mod.load_model
def slow_load(*args, **kwargs):  # make the two processes overlap
    time.sleep(0.3)
    return real_load(*args, **kwargs)
sweep_mod.load_model = slow_load
config = sweep_mod.SweepConfig(batch_size=2, attribution=AttributionConfig(enabled=False))
summary = sweep_mod.sweep(from_local({folder!r}), eval_data(), {run!r}, config, progress=False)
print(json.dumps({{"done": summary.done, "busy": summary.busy, "skipped": summary.skipped}}))
"""


@pytest.mark.slow
def test_two_concurrent_sweep_processes_never_probe_a_checkpoint_twice(folder, reference, tmp_path):
    """The lock holds across operating-system processes, not only threads."""
    import subprocess
    import sys

    run = tmp_path / "run"
    code = _SWEEP_PROCESS.format(tests=str(Path(__file__).parents[1]), folder=str(folder), run=str(run))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    a, b = (set(o["done"]) for o in outs)
    assert not a & b  # no checkpoint probed by both
    assert sorted(a | b) == sorted(from_local(folder).revisions)
    assert _files(run) == _files(reference)


def test_a_failure_fixed_on_resume_is_no_longer_a_failure(folder, tmp_path):
    local = tmp_path / "seq"
    write_sequence(local, steps=[0, 2, 4])
    good = (local / "step2" / "model.safetensors").read_bytes()
    (local / "step2" / "model.safetensors").write_bytes(b"broken")
    run = tmp_path / "run"
    first = sweep(from_local(local), eval_data(), run, CONFIG, progress=False)
    assert first.failed == ["step2"]
    assert [f["revision"] for f in results.read_failures(run)] == ["step2"]
    (local / "step2" / "model.safetensors").write_bytes(good)
    again = sweep(from_local(local), eval_data(), run, CONFIG, progress=False)
    assert again.done == ["step2"]
    assert results.read_failures(run) == []


@pytest.mark.parametrize("prefetch", [False, True])
def test_each_model_is_gone_when_the_cleanup_runs(folder, tmp_path, monkeypatch, prefetch):
    refs: dict[str, weakref.ref] = {}
    real_load = sweep_mod.load_model

    def tracked(*args, **kwargs):
        model = real_load(*args, **kwargs)
        refs[str(len(refs))] = weakref.ref(model)  # loads happen in checkpoint order
        return model

    alive_at_cleanup: list[list[str]] = []
    real_collect = gc.collect

    class TrackingGC:
        @staticmethod
        def collect(*args):
            n = real_collect(*args)
            alive_at_cleanup.append([k for k, r in refs.items() if r() is not None])
            return n

    monkeypatch.setattr(sweep_mod, "load_model", tracked)
    monkeypatch.setattr(sweep_mod, "gc", TrackingGC)
    seq = from_local(folder).select(steps=[0, 4, 16])
    config = SweepConfig(batch_size=2, prefetch=prefetch, attribution=AttributionConfig(enabled=False))
    sweep(seq, eval_data(), tmp_path / "run", config, progress=False)
    assert len(alive_at_cleanup) == 3
    for i, alive in enumerate(alive_at_cleanup):
        # checkpoint i's model and all before it are freed; only the prefetched next one may live
        assert alive == ([str(i + 1)] if prefetch and i + 1 < 3 else []), (i, alive)


def test_probe_with_an_unloadable_tokenizer_is_one_line_exit_2(folder, capsys, monkeypatch):
    """transformers raises OSError when a tokenizer cannot be read (simulated here: a local
    folder rarely triggers it); before the fix it escaped ``peakprobe probe`` as a traceback."""
    import transformers

    def unreadable(*args, **kwargs):
        raise OSError("Can't load tokenizer: read error")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreadable)
    assert main(["probe", str(folder / "step4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peakprobe: error: cannot load a tokenizer")


def test_new_errors_are_one_line_exit_2_and_keep_what_is_written(folder, reference, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoints", "manifest.json", "integrity.json"):  # a finished run
        src = reference / name
        if src.is_dir():
            (run / name).mkdir()
            for f in src.iterdir():
                (run / name / f.name).write_bytes(f.read_bytes())
        else:
            (run / name).write_bytes(src.read_bytes())
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    bad_schedule = tmp_path / "lr.json"
    bad_schedule.write_text(json.dumps({"learning_rate": [1, 2]}))
    text = tmp_path / "eval.txt"
    text.write_text(embedded_text(20))
    common = ["--out", str(run), "-q"]
    cases = [
        (["sweep", str(folder), *common, "--shard", "2/2"], "--shard must be K/N"),
        (["sweep", str(folder), *common, "--shard", "a/b"], "--shard must be K/N"),
        (["sweep", str(folder), *common, "--shard", "0/2", "--force"], "--force with --shard"),
        (["sweep", str(folder), *common, "--schedule", str(bad_schedule)], "accepted schedule forms"),
        (["index", str(folder), "--schedule", str(bad_schedule)], "accepted schedule forms"),
        (["sweep", "pythia-70m", *common], "--data embedded"),
        (["run", "EleutherAI/pythia-160m", *common, "--select", "4"], "--data embedded"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("peakprobe: error:") and needle in err[0], (argv, err)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
