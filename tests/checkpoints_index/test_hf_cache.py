"""Checkpoint families as researchers hold them: revisions pre-downloaded into the HF cache and
swept offline (Pythia and OLMo-2 names, all or some revisions cached, main never cached),
duplicate weights flagged from blob hashes, and --prune-cache deleting only what the sweep
downloaded. The cache is built in tmp_path with the layout huggingface_hub writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import _sequence_model, embedded_text, eval_data
from helpers.hf_cache import cache_revision
from huggingface_hub import scan_cache_dir

from peakprobe import results
from peakprobe.checkpoints_index import cached_refs, from_local, integrity_record, pythia
from peakprobe.cli import main
from peakprobe.sweep import SweepConfig, sweep

PYTHIA_ID = "EleutherAI/pythia-14m"
OLMO2_ID = "allenai/OLMo-2-1124-7B"
PYTHIA_STEPS = [1, 2, 4, 8, 16, 32, 64, 128]


def olmo2_branch(step: int) -> str:
    return f"stage1-step{step}-tokens{step * 4}M"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """save_pretrained folders (tiny GPT-NeoX + tokenizer) for each step."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for step in PYTHIA_STEPS:
        model, tok = _sequence_model(step)
        model.save_pretrained(root / str(step))
        tok.save_pretrained(root / str(step))
        out[step] = root / str(step)
    return out


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "eval.txt"
    path.write_text(embedded_text(40))
    return path


ARGS = ["--n-windows", "4", "--window", "24", "--batch-size", "2", "--n-boot", "20",
        "--time-axis", "step", "--t-min", "1",
        "--no-attribution", "-q"]


def pythia_branch(step: int) -> str:
    return f"step{step}"


SOME = [1, 4, 8, 32, 128]


@pytest.mark.parametrize("repo,branch,cached", [
    pytest.param(PYTHIA_ID, pythia_branch, PYTHIA_STEPS, id="pythia-all"),
    pytest.param(OLMO2_ID, olmo2_branch, SOME, id="olmo2-some"),
    pytest.param(PYTHIA_ID, pythia_branch, SOME, id="pythia-some", marks=pytest.mark.slow),
    pytest.param(OLMO2_ID, olmo2_branch, PYTHIA_STEPS, id="olmo2-all", marks=pytest.mark.slow),
])
def test_offline_run_from_the_cache(saved, hf_home, text_file, tmp_path, capsys, repo, branch, cached):
    for step in cached:
        cache_revision(hf_home / "hub", repo, branch(step), saved[step])
    scanned = {r.repo_id: r for r in scan_cache_dir(hf_home / "hub").repos}  # the layout is valid
    assert {ref for rev in scanned[repo].revisions for ref in rev.refs} == {branch(s) for s in cached}
    assert main(["index", repo]) == 0
    listed = capsys.readouterr().out
    assert all(branch(s) in listed for s in cached) and "main" not in listed.split()
    out = tmp_path / "R"
    code = main(["run", repo, "--out", str(out), "--select", "6", "--data", str(text_file), *ARGS])
    err = capsys.readouterr().err
    assert code == 0, err
    written = sorted(p.stem for p in (out / "checkpoints").glob("*.parquet"))
    assert len(written) == min(6, len(cached)) and set(written) <= {branch(s) for s in cached}
    if len(cached) < 6:  # one line says what was requested but is not there
        assert "requested 6 checkpoints, selected 5: only 5 of the" in err and "in the HF cache" in err
    manifest = results.read_manifest(out)
    assert manifest["family"] == ("pythia" if repo == PYTHIA_ID else "olmo2")
    assert all(c["tau"] is not None for c in manifest["checkpoints"])  # published schedules
    assert (out / "report").is_dir() and (out / results.INTEGRITY).exists()


def test_offline_steps_missing_from_the_cache_are_named_in_one_line(saved, hf_home, text_file, tmp_path, capsys):
    for step in (1, 2, 4):
        cache_revision(hf_home / "hub", PYTHIA_ID, f"step{step}", saved[step])
    out = tmp_path / "R"
    assert main(["sweep", PYTHIA_ID, "--out", str(out), "--steps", "1,4,1000,2000",
                 "--data", str(text_file), *ARGS[:6], "-q"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "not in the HF cache" in line] == [
        "peakprobe: warning: 2 requested revisions are not in the HF cache and are skipped: step1000, step2000"]
    assert sorted(p.stem for p in (out / "checkpoints").glob("*.parquet")) == ["step1", "step4"]
    # nothing cached at all: one line, exit 2, nothing written
    assert main(["sweep", "EleutherAI/pythia-70m", "--out", str(tmp_path / "none"), "--select", "3",
                 "--data", str(text_file), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in the HF cache" in err[0] and not (tmp_path / "none").exists()


@pytest.mark.slow
def test_offline_run_in_a_fresh_process(saved, hf_home, text_file, tmp_path):
    """The same through a subprocess, where HF_HOME / HF_HUB_OFFLINE are read at import time."""
    for step in PYTHIA_STEPS[:6]:
        cache_revision(hf_home / "hub", OLMO2_ID, olmo2_branch(step), saved[step])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "peakprobe", "run", OLMO2_ID, "--out", str(tmp_path / "R"),
                           "--select", "6", "--data", str(text_file), *ARGS],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((tmp_path / "R" / "checkpoints").glob("*.parquet"))) == 6


def _planted_duplicates(saved: dict[int, Path], root: Path) -> tuple[dict[int, Path], list[str]]:
    """8 sharded checkpoints: step8 = step4 byte for byte; step32 shares exactly its first shard
    with step64 (every parameter stored in a later shard is changed)."""
    folders = {}
    for step in sorted(PYTHIA_STEPS, key=lambda s: s == 32):  # step64 first: step32 reads its shards
        model, tok = _sequence_model({8: 4, 32: 64}.get(step, step))
        if step == 32:
            index = json.loads((folders[64] / "model.safetensors.index.json").read_text())
            first = min(index["weight_map"].values())
            with torch.no_grad():
                for name, t in model.state_dict().items():  # parameters and saved buffers
                    if index["weight_map"].get(name) != first and t.is_floating_point():  # lm_head is saved as embed_out
                        t.add_(0.01)
        folders[step] = root / f"step{step}"
        model.save_pretrained(folders[step], max_shard_size="40KB")
        tok.save_pretrained(folders[step])
    shards = sorted(p.name for p in folders[32].glob("*.safetensors"))
    return folders, shards


def test_duplicate_weights_are_flagged_whole_and_partial(saved, hf_home, tmp_path):
    folders, shards = _planted_duplicates(saved, tmp_path / "local")
    assert len(shards) >= 3
    same = [n for n in shards if (folders[32] / n).read_bytes() == (folders[64] / n).read_bytes()]
    assert same == [shards[0]]  # the planted partial duplicate shares exactly one shard
    expected = {
        "step4": {"step": 4, "duplicates": ["step8"], "files": shards, "whole": True},
        "step32": {"step": 32, "duplicates": ["step64"], "files": [shards[0]], "whole": False},
    }
    # local folders: content hashes
    assert integrity_record(from_local(tmp_path / "local"), offline=True)["flagged"] == expected
    # the HF cache: blob names, through a sweep that writes integrity.json
    for step, folder in folders.items():
        cache_revision(hf_home / "hub", PYTHIA_ID, f"step{step}", folder)
    seq = pythia("14m", steps=tuple(PYTHIA_STEPS))
    run = tmp_path / "run"
    sweep(seq, eval_data(n=2), run, SweepConfig(batch_size=2, local_files_only=True), progress=False)
    record = json.loads((run / "integrity.json").read_text())
    assert record["flagged"] == expected and record["unchecked"] == []
    assert record["checked"] == [f"step{s}" for s in PYTHIA_STEPS]
    assert set(results.read_integrity(run)) == {"step4", "step32"}
    assert results.read_integrity(tmp_path) == {}  # no integrity.json: nothing to exclude


def test_prune_cache_deletes_only_what_the_sweep_downloaded(saved, hf_home, tmp_path, monkeypatch):
    """Downloads are simulated: a hook in front of load_model copies a revision into the cache
    the first time the sweep loads it (what from_pretrained would do online), then loads it with
    local_files_only=True. What is tested: which revisions --prune-cache deletes, and that every
    result is written first."""
    import peakprobe.sweep as sweep_mod

    before = [1, 8, 64]
    for step in before:
        cache_revision(hf_home / "hub", PYTHIA_ID, f"step{step}", saved[step])
    real_load = sweep_mod.load_model
    downloaded = []

    def download_then_load(source, revision, config, device):
        if revision not in cached_refs(source):
            cache_revision(hf_home / "hub", source, revision, saved[int(revision[4:])])
            downloaded.append(revision)
        return real_load(source, revision, config, device)

    monkeypatch.setattr(sweep_mod, "load_model", download_then_load)
    seq = pythia("14m", steps=(1, 2, 4, 8, 16, 64))
    run = tmp_path / "run"
    summary = sweep(seq, eval_data(n=2), run, SweepConfig(batch_size=2, local_files_only=True),
                    prune_cache=True, progress=False)
    assert sorted(summary.done) == sorted(seq.revisions) and not summary.failed
    assert sorted(downloaded) == ["step16", "step2", "step4"]
    assert sorted(summary.pruned) == sorted(downloaded)
    assert sorted(cached_refs(PYTHIA_ID)) == ["step1", "step64", "step8"]
    assert all(results.checkpoint_path(run, r).exists() for r in seq.revisions)
    repo = {r.repo_id: r for r in scan_cache_dir(hf_home / "hub").repos}[PYTHIA_ID]
    assert len(repo.revisions) == 3  # snapshots of the downloads are gone, the rest intact


def test_unreachable_hub_falls_back_to_the_cache_with_one_note(saved, hf_home, text_file, tmp_path,
                                                             capsys, monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    for step in (1, 4):
        cache_revision(hf_home / "hub", PYTHIA_ID, f"step{step}", saved[step])
    out = tmp_path / "R"
    assert main(["sweep", PYTHIA_ID, "--out", str(out), "--steps", "1,4", "--data", str(text_file),
                 *ARGS[:6], "-q"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"peakprobe: warning: the hub is unreachable: using the revisions of {PYTHIA_ID} in the HF cache"]
    assert sorted(p.stem for p in (out / "checkpoints").glob("*.parquet")) == ["step1", "step4"]
