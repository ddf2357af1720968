"""``peakprobe run`` end to end on a tiny local checkpoint sequence, in-process: every report
file exists and agrees with what ``fit`` wrote; ``peakprobe probe`` and ``index`` print tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers import STEPS, embedded_text, write_sequence

from peakprobe import vocab
from peakprobe.cli import main


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seq")
    write_sequence(folder)
    run = tmp_path_factory.mktemp("run")
    code = main(["run", str(folder), "--out", str(run), "--n-windows", "4", "--window", "24",
                 "--n-boot", "200", "-q"])
    assert code == 0
    return folder, run


def test_run_writes_every_report_file_consistent_with_the_fits(finished_run):
    _, run = finished_run
    report = run / "report"
    for name in ("report.html", "heads.csv", "heads.parquet", "summary.json", "summary.md"):
        assert (report / name).stat().st_size > 0, name
    pngs, svgs = sorted((report / "figures").glob("*.png")), sorted((report / "figures").glob("*.svg"))
    assert pngs and [p.stem for p in pngs] == [s.stem for s in svgs]

    fits = pd.read_parquet(run / "fits.parquet")
    verdict = json.loads((run / "fits.json").read_text())
    growth = fits[(fits.fit == "growth") & (fits.metric == "logit_std")]
    heads = pd.read_parquet(report / "heads.parquet")
    merged = heads.merge(growth, on=["site_kind", "layer", "head"], suffixes=("", "_fit"))
    assert len(merged) == len(growth) == 2 * 4 + 1  # 2 layers x 4 heads + the LM head
    np.testing.assert_allclose(merged["alpha"], merged["alpha_fit"], equal_nan=True)
    assert (merged["site_class"].fillna("") == merged["site_class_fit"].fillna("")).all()
    # The heatmap's data is the fitted alphas laid out as layer x head.
    from peakprobe.reports.tables import site_matrix

    grid = site_matrix(heads, "alpha")
    attn = growth[growth.site_kind == "attn"]
    for r in attn.itertuples():
        assert grid[r.layer, r.head] == pytest.approx(r.alpha, nan_ok=True)
    summary = json.loads((report / "summary.json").read_text())
    loss = fits[fits.fit == "loss"].iloc[0]
    assert summary["loss"]["alpha"] == pytest.approx(loss["alpha"])
    assert summary["loss"]["alpha"] == pytest.approx(verdict["loss"]["alpha"])
    assert summary["bottleneck"]["verdict"] == verdict["bottleneck"]["verdict"]
    csv = pd.read_csv(report / "heads.csv")
    assert len(csv) == len(heads)


def test_report_is_deterministic_apart_from_the_html(finished_run):
    _, run = finished_run
    before = {p.name: p.read_bytes() for p in (run / "report").iterdir() if p.is_file()}
    assert main(["report", str(run), "-q"]) == 0
    after = {p.name: p.read_bytes() for p in (run / "report").iterdir() if p.is_file()}
    for name in before:
        if name != "report.html":
            assert before[name] == after[name], name


def test_probe_and_index_print_tables(finished_run, capsys):
    folder, _ = finished_run
    assert main(["index", str(folder)]) == 0
    out = capsys.readouterr().out
    assert all(f"step{s}" in out for s in STEPS)
    text = folder.parent / "probe-eval.txt"
    text.write_text(embedded_text(20))
    assert main(["probe", str(folder / "step64"), "--data", str(text), "--n-windows", "2",
                 "--window", "24"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["site", "peaked_entropy", "beta_eff"]
    assert sum(line.startswith("attn L") for line in lines) == 8  # 2 layers x 4 heads
    assert sum(line.startswith("LM head") for line in lines) == 1


def test_fit_with_too_few_checkpoints_is_a_one_line_error(finished_run, tmp_path, capsys):
    folder, _ = finished_run
    run = tmp_path / "few"
    assert main(["sweep", str(folder), "--out", str(run), "--steps", "0,1",
                 "--n-windows", "2", "--window", "24", "-q"]) == 0
    assert main(["fit", str(run), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoints" in err[0]


def test_toy_linear_quick_from_the_command_line(tmp_path):
    assert main(["toy", "linear", "--quick", "--out", str(tmp_path), "-q"]) == 0
    summary = json.loads((tmp_path / vocab.TOY_FILE).read_text())
    # Softmax-free attention: the time exponent is set by the data spectrum, a / (1 + a) for
    # feature frequencies ~ k^-(1 + a), not by 1/3.
    a = summary["config"]["zipf_a"]
    assert summary["time"]["alpha_sim"] == pytest.approx(a / (1 + a), abs=0.05)
    assert abs(summary["time"]["alpha_sim"] - 1 / 3) > 0.05
    assert [p.name for p in sorted(tmp_path.glob("*.png"))] == sorted(summary["plots"])


