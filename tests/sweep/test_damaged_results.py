"""Damaged run directories heal: a checkpoint file that does not read back (cut short, emptied,
another schema, another run's) is moved aside, said in one line and probed again on resume, to
the same bytes as an undamaged run; ``fit``, ``report`` and ``compare`` meeting a damaged
checkpoint, manifest.json, integrity.json, fits.parquet or fits.json exit 2 with one line naming
the file and the command that writes it again; no other result is lost."""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import tiny_model, write_sequence
from helpers.trainer_run import eval_windows

from peakprobe import results
from peakprobe.cli import main
from peakprobe.integrations import Monitor
from peakprobe.sweep import DamagedFileWarning

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = [0, 4, 16, 64]
ARGS = ["--n-windows", "4", "--window", "24", "--batch-size", "2", "--no-attribution", "-q"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished, fitted sweep over four local checkpoints, and the folder it came from."""
    root = tmp_path_factory.mktemp("heal")
    write_sequence(root / "seq", STEPS)
    run = root / "run"
    assert main(["sweep", str(root / "seq"), "--out", str(run), *ARGS]) == 0
    assert main(["fit", str(run), "-q", "--t-min-step", "4"]) in (0, 1)  # too few points: 1
    assert (run / results.FITS_JSON).exists()
    return root / "seq", run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("locks", "report"))
    return to


def _files(run: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in (run / results.CHECKPOINTS).glob("*.parquet")}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("peakprobe: error:") and "bug" not in err[0]
    return err[0]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _other_schema(path: Path) -> None:
    df = pd.read_parquet(path).drop(columns=["n_rows"])
    df["value"] = df["value"].astype(str)
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)


def _other_model(path: Path) -> None:
    df = pd.read_parquet(path).assign(model="another-model")
    results.write_parquet(path, df, results.RESULT_SCHEMA)


def _other_checkpoint(path: Path) -> None:
    shutil.copy(path.with_name("step64.parquet"), path)  # a copy under the wrong name


DAMAGE = {
    "truncated": (_truncate, "is not a readable parquet file"),
    "zero bytes": (_empty, "is empty (0 bytes)"),
    "other schema": (_other_schema, "does not have the results schema (columns value, n_rows)"),
    "other run": (_other_model, "holds model another-model, not this run's seq"),
    "other checkpoint": (_other_checkpoint, "holds revision step64, not step16"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_stops_fit_in_one_line_and_heals_on_resume(reference, tmp_path, capsys, kind):
    seq, ref = reference
    damage, said = DAMAGE[kind]
    run = _copy(ref, tmp_path / "run")
    bad = run / results.CHECKPOINTS / "step16.parquet"
    damage(bad)
    before = {f: (run / results.CHECKPOINTS / f).stat().st_mtime_ns for f in _files(run) if f != bad.name}

    for command in (["fit", str(run)], ["report", str(run)]):
        assert main(command) == 2
        line = _error_line(capsys)
        assert f"{bad} {said}" in line
        assert f"`peakprobe sweep {seq} --out {run} " in line and "probes it again" in line

    assert main(["sweep", str(seq), "--out", str(run), *ARGS]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"peakprobe: warning: {bad} {said}" + err[0].split(said, 1)[1]]
    assert err[0].endswith("moved aside to step16.parquet.damaged; probing it again")
    assert (run / results.CHECKPOINTS / "step16.parquet.damaged").exists()
    assert _files(run) == _files(ref)  # probed again to the same bytes, the others kept
    assert {f: (run / results.CHECKPOINTS / f).stat().st_mtime_ns for f in before} == before
    assert main(["sweep", str(seq), "--out", str(run), *ARGS]) == 0  # healed: nothing more to do
    assert capsys.readouterr().err == ""
    assert main(["fit", str(run), "-q", "--t-min-step", "4"]) in (0, 1)
    assert "error" not in capsys.readouterr().err


def test_damaged_manifest_and_integrity_are_one_line_errors_and_written_again(reference, tmp_path, capsys):
    seq, ref = reference
    for name in (results.MANIFEST, results.INTEGRITY):
        run = _copy(ref, tmp_path / name)
        _truncate(run / name)
        assert main(["fit", str(run)]) == 2
        line = _error_line(capsys)
        assert f"{run / name} does not read back (JSONDecodeError" in line and "writes it again" in line
        assert main(["sweep", str(seq), "--out", str(run), *ARGS]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{run / name} does not read back" in err[0]
        assert err[0].endswith(f"moved aside to {name}.damaged; writing it again")
        assert results.read_json(run / name) == results.read_json(ref / name) or name == results.MANIFEST
        assert results.run_identity(results.read_manifest(run)) == results.run_identity(results.read_manifest(ref))
        assert _files(run) == _files(ref)
        assert main(["fit", str(run), "-q", "--t-min-step", "4"]) in (0, 1)
        assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("name", [results.FITS, results.FITS_JSON])
@pytest.mark.parametrize("damage", [_truncate, _empty])
def test_damaged_fits_stop_report_and_compare_in_one_line_naming_fit(reference, tmp_path, capsys, name, damage):
    _, ref = reference
    run = _copy(ref, tmp_path / "run")
    damage(run / name)
    for command in (["report", str(run)], ["compare", str(run), str(ref), "--out", str(tmp_path / "c")]):
        assert main(command) == 2
        line = _error_line(capsys)
        assert str(run / name) in line and line.endswith(f"`peakprobe fit {run}` writes it again")
    assert main(["fit", str(run), "-q", "--t-min-step", "4"]) in (0, 1)
    assert main(["report", str(run), "-q"]) == 0
    assert _files(run) == _files(ref)


def test_a_cut_failures_log_is_read_past(reference, tmp_path):
    _, ref = reference
    run = _copy(ref, tmp_path / "run")
    (run / results.FAILURES).write_text('{"revision": "step4", "error": "OSError: x"}\n{"revis')
    assert main(["report", str(run), "-q"]) == 0


def test_a_resumed_live_run_moves_a_damaged_step_aside_and_probes_it_again(tmp_path, caplog):
    model = tiny_model("gpt_neox", dtype=torch.float32)
    data = eval_windows()
    first = Monitor(data, tmp_path / "run", total_steps=2, model=model, lr_max=1.0)
    for step in (0, 1, 2):
        first.step(step)
    good = _files(tmp_path / "run")
    _truncate(tmp_path / "run" / results.CHECKPOINTS / "step1.parquet")
    again = Monitor(data, tmp_path / "run", total_steps=2, model=model, lr_max=1.0)
    with warnings.catch_warnings(record=True) as said, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        again.step(1)  # the training resumed from before step 1
    said = [str(w.message) for w in said if issubclass(w.category, DamagedFileWarning)]
    assert len(said) == 1 and "step1.parquet is not a readable parquet file" in said[0]
    assert _files(tmp_path / "run") == good
    assert (tmp_path / "run" / results.CHECKPOINTS / "step1.parquet.damaged").exists()
