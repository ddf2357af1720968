"""The embedded demo end to end (shortened): train the tiny LM, sweep, fit, report."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from peakprobe import results, vocab
from peakprobe.cli import main


def test_quick_demo_runs_the_whole_pipeline_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["demo", "--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    html = tmp_path / "run" / "report" / "report.html"
    assert f"report: {html}" in out
    assert "loss:" in out and "bottleneck:" in out
    summary = json.loads((tmp_path / "run" / "report" / "summary.json").read_text())
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    fits = pd.read_parquet(tmp_path / "run" / "fits.parquet")
    # the run directory comes from the live Monitor: about 40 probes, 30+ of them in the fit
    planned = [c["revision"] for c in manifest["checkpoints"]]
    assert len(planned) == vocab.MONITOR_POINTS
    done = sorted(p.stem for p in (tmp_path / "run" / "checkpoints").glob("*.parquet"))
    assert done == sorted(planned)
    assert fits[fits.fit == "loss"]["n_points"].item() >= 30
    assert summary["loss"]["alpha"] > 0  # the loss falls along training
    saved = sorted(p.name for p in (tmp_path / "tiny-pythia").glob("step*"))
    assert 2 <= len(saved) < len(planned)  # a few saved checkpoints remain for a later sweep
    # Re-running reuses the trained checkpoints and the finished run directory.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "checkpoints").iterdir()}
    assert main(["demo", "--out", str(tmp_path), "--quick", "-q"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "checkpoints").iterdir()} == before

    # The live probes are a sweep's of the saved checkpoints, bit for bit, tau included.
    assert main(["sweep", str(tmp_path / "tiny-pythia"), "--out", str(tmp_path / "swept"),
                 "--n-windows", "16", "--window", "64", "-q",
                 "--attribution-windows", str(vocab.MONITOR_ATTRIBUTION_WINDOWS)]) == 0
    live, swept = results.read_results(tmp_path / "run"), results.read_results(tmp_path / "swept")
    assert results.read_manifest(tmp_path / "swept")["data"] == manifest["data"]
    # (the live attribution runs at a log-spaced subset only: elsewhere the statistics alone)
    cols = ["step", "tau", "site_kind", "layer", "head", "metric", "value", "n_rows"]
    attributed = set(manifest["attribution"]["steps"])
    common = sorted(set(swept.step) & set(live.step))
    for step in common:
        rows = swept[swept.step == step]
        if step not in attributed:
            rows = rows[~rows.metric.isin(vocab.ATTRIBUTION_ROW_METRICS)]
        pd.testing.assert_frame_equal(live[live.step == step][cols].reset_index(drop=True),
                                      rows[cols].reset_index(drop=True), check_exact=True)
    assert len(common) >= 3 and len(attributed & set(common)) >= 1


@pytest.mark.slow
def test_full_demo_grows_a_peaked_attention_head(tmp_path, default_tiny_lm):
    """The README's demo: by the last checkpoint some head is peaked (logit std above
    sqrt(2 ln n) in most rows) and its logit std has grown along training. The demo trains
    the copied run again (same seed, same weights), since its live Monitor must see the
    training; the copy only checks that a finished run of the same config is accepted."""
    shutil.copytree(default_tiny_lm, tmp_path / "tiny-pythia")
    assert main(["demo", "--out", str(tmp_path), "-q"]) == 0
    df = results.read_results(tmp_path / "run")
    attn = df[df.site_kind == "attn"]
    last, first = attn.step.max(), attn.step.min()
    peaked = attn[(attn.metric == "peaked") & (attn.step == last) & (attn.value > 0.5)]
    assert len(peaked) >= 1
    std = attn[attn.metric == "logit_std"].set_index(["layer", "head", "step"])["value"]
    for r in peaked.itertuples():
        assert std[(r.layer, r.head, last)] > 3 * std[(r.layer, r.head, first)]
    verdict = json.loads((tmp_path / "run" / "fits.json").read_text())
    assert verdict["bottleneck"]["n_concentrating"] >= 1
    # a head takes a role during training (the corpus's long copy segments grow a
    # previous-token head): its score stays at or above the threshold from its step on
    roles = json.loads((tmp_path / "run" / "report" / "summary.json").read_text())["roles"]
    assert roles["measured"] and roles["heads"]
    for h in roles["heads"]:
        metric = vocab.ROLE_OF[h["role"]]
        s = attn[(attn.metric == metric) & (attn.layer == h["layer"]) & (attn["head"] == h["head"])]
        s = s.set_index("step")["value"].sort_index()
        assert first < h["since_step"] <= last
        assert (s[s.index >= h["since_step"]] >= vocab.ROLE_THRESHOLD).all()
        assert s[s.index < h["since_step"]].iloc[-1] < vocab.ROLE_THRESHOLD
