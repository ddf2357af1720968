"""The hub path against a real HTTP server (tests/helpers/hub_server.py): ``peakprobe`` runs in a
subprocess with ``HF_ENDPOINT`` pointing at it, so the real huggingface_hub and transformers code
lists the refs, resolves files at step<N> revisions, follows LFS redirects and downloads.

A tiny family is served with one revision per weight layout (safetensors, a pytorch_model.bin
only, sharded safetensors); a sweep of it by hub id equals a sweep of the same folders on disk.
Planted faults: 503 answers (retried), connections cut mid-file (fetched again) or reset
(retried; when they persist,
that checkpoint fails in one line, the others are kept, and no partial file reaches the cache
as complete), a revision that does not exist, a gated repo."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import _sequence_model, embedded_text
from helpers.hub_server import HubServer

from peakprobe import results
from peakprobe.cli import main
from peakprobe.sweep import LOAD_TRIES

ROOT = Path(__file__).resolve().parents[2]
REPO = "tiny-org/served-pythia"
STEPS = [0, 4, 16, 64]
ARGS = ["--n-windows", "4", "--window", "24", "--batch-size", "2", "--no-attribution"]
SHARD = "model-00002-of-00004.safetensors"  # of step16


def _write_revision(folder: Path, step: int) -> None:
    """step4: pytorch_model.bin only (as early Pythia revisions); step16: sharded safetensors."""
    model, tok = _sequence_model(step)
    if step == 4:
        folder.mkdir(parents=True)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(folder, max_shard_size="40KB" if step == 16 else "1GB")
    tok.save_pretrained(folder)


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """The family on disk, the same served by a local hub (for the whole session), eval text."""
    root = tmp_path_factory.mktemp("hub")
    for step in STEPS:
        _write_revision(root / "local" / f"step{step}", step)
    assert len(list((root / "local" / "step16").glob("model-*.safetensors"))) == 4
    (root / "eval.txt").write_text(embedded_text(50))
    with HubServer() as hub:
        for step in STEPS:
            hub.add_revision(REPO, f"step{step}", root / "local" / f"step{step}")
        hub.add_revision("tiny-org/gated", "step0", root / "local" / "step0", gated=True)
        yield root, hub


def _peakprobe(family, home: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m peakprobe ARGS`` against the local hub, with its own HF cache."""
    root, hub = family
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "peakprobe", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)


def _values(run: Path) -> pd.DataFrame:
    df = results.read_results(run)
    return df[["revision", "step", "site_kind", "layer", "head", "metric", "value", "n_rows"]]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("peakprobe:")
            and "tau is unknown" not in line and "fit skipped" not in line]


@pytest.fixture(scope="session")
def local_run(family, tmp_path_factory):
    root, _ = family
    out = tmp_path_factory.mktemp("local") / "run"
    assert main(["sweep", str(root / "local"), "--out", str(out), "--data", str(root / "eval.txt"),
                 "--allow-pickle", "-q", *ARGS]) == 0
    return out


def _cache_is_whole(home: Path) -> list[str]:
    """The HF cache's LFS blobs: each complete one hashes to its name; none left incomplete."""
    blobs = list(home.rglob("blobs/*"))
    for p in blobs:
        if len(p.name) == 64 and not p.name.endswith(".incomplete"):
            assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name, p
    return [p.name for p in blobs]


def test_index_by_hub_id_lists_the_served_revisions(family, tmp_path, capsys):
    root, _ = family
    done = _peakprobe(family, tmp_path / "hf", "index", REPO)
    assert done.returncode == 0, done.stderr
    assert main(["index", str(root / "local")]) == 0
    local = capsys.readouterr().out

    def rows(text):
        return [line.split()[:2] for line in text.splitlines() if line.startswith("step")]

    assert rows(done.stdout) == rows(local) == [[f"step{s}", str(s)] for s in STEPS]


def test_a_gated_repo_says_to_log_in_with_hf_auth_login(family, tmp_path):
    done = _peakprobe(family, tmp_path / "hf", "index", "tiny-org/gated")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("peakprobe: error: hub repo tiny-org/gated is gated") and "`hf auth login`" in line


def test_a_revision_that_does_not_exist_is_named_in_one_line(family, tmp_path):
    done = _peakprobe(family, tmp_path / "hf", "sweep", REPO, "--out", str(tmp_path / "run"),
                      "--revisions", "step999", "--data", "eval.txt", *ARGS)
    assert done.returncode == 2
    (line,) = _errors(done.stderr)
    assert line.startswith("peakprobe: error:") and "step999" in line
    assert not (tmp_path / "run" / results.CHECKPOINTS).exists()


@pytest.mark.slow
def test_a_run_by_hub_id_equals_the_local_folders_through_503s_and_a_reset(family, local_run, tmp_path):
    _, hub = family
    hub.fail("/config.json", 503, method="HEAD")  # huggingface_hub retries its metadata call
    hub.fail("/model.safetensors", 503)  # a 503 on a weight download: the sweep loads it again
    hub.fail(f"/{SHARD}", "reset")  # half the shard, then a reset: the sweep loads it again
    hub.fail("/pytorch_model.bin", "cut")  # half the file, then closed: huggingface_hub retries
    seen = len(hub.requests)
    done = _peakprobe(family, tmp_path / "hf", "run", REPO, "--out", str(tmp_path / "run"),
                      "--data", "eval.txt", "--allow-pickle", "-q", *ARGS)
    assert done.returncode in (0, 1), done.stderr  # 1: a fit skipped for four checkpoints
    assert not _errors(done.stderr), done.stderr
    pd.testing.assert_frame_equal(_values(tmp_path / "run"), _values(local_run))
    assert (tmp_path / "run" / results.FITS_JSON).exists() and (tmp_path / "run" / "report").exists()
    log = hub.requests[seen:]
    assert [s for _, p, s in log if s in (503, -1, -2)] == [503, 503, -2, -1]
    got = {p.rsplit("/", 1)[-1] for m, p, s in log if m == "GET" and s in (200, 206)}
    assert {"pytorch_model.bin", "model.safetensors.index.json", SHARD, "model.safetensors"} <= got
    assert SHARD in {p.rsplit("/", 1)[-1] for _, p, s in log if s == -1}
    bin_gets = [s for m, p, s in log if m == "GET" and p.endswith("/pytorch_model.bin")]
    assert bin_gets == [-2, 200]  # huggingface_hub fetched it again (a small file: from byte 0)
    _cache_is_whole(tmp_path / "hf")


@pytest.mark.slow
def test_a_download_that_keeps_breaking_fails_that_checkpoint_alone(family, local_run, tmp_path):
    _, hub = family
    hub.fail(f"/{SHARD}", "reset", times=LOAD_TRIES * 6)  # more than every retry of every layer
    args = ["sweep", REPO, "--out", str(tmp_path / "run"), "--data", "eval.txt", "-q", *ARGS]
    done = _peakprobe(family, tmp_path / "hf", *args)
    hub.faults.clear()
    assert done.returncode == 1
    (line,) = _errors(done.stderr)
    assert line.startswith("peakprobe: 2 checkpoints failed (step4, step16; step4: CheckpointError: ")
    assert "--allow-pickle" in line and "re-run to retry" in line
    assert sorted(p.name for p in (tmp_path / "run" / results.CHECKPOINTS).iterdir()) == [
        "step0.parquet", "step64.parquet"]
    shard = hashlib.sha256((family[0] / "local" / "step16" / SHARD).read_bytes()).hexdigest()
    assert shard not in _cache_is_whole(tmp_path / "hf")  # never complete under its hash
    assert not list((tmp_path / "hf").rglob(f"snapshots/*/{SHARD}"))
    failures = {r["revision"]: r["error"] for r in results.read_failures(tmp_path / "run")}
    assert failures["step16"].startswith("ReadError")

    again = _peakprobe(family, tmp_path / "hf", *args, "--allow-pickle")
    assert again.returncode == 0, again.stderr
    pd.testing.assert_frame_equal(_values(tmp_path / "run"), _values(local_run))
    _cache_is_whole(tmp_path / "hf")


def test_a_download_resumes_with_a_range_request(family, tmp_path):
    """huggingface_hub's own resume (files over its 10 MB chunk) asks for the rest with Range."""
    from huggingface_hub.file_download import http_get

    root, hub = family
    data = (root / "local" / "step64" / "model.safetensors").read_bytes()
    url = f"{hub.cdn}/cdn/{hashlib.sha256(data).hexdigest()}/model.safetensors"
    seen = len(hub.requests)
    with open(tmp_path / "part", "wb") as fh:
        fh.write(data[:1000])
        http_get(url, fh, resume_size=1000, expected_size=len(data))
    assert (tmp_path / "part").read_bytes() == data
    assert [s for _, _, s in hub.requests[seen:]] == [206]
