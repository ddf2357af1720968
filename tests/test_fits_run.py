"""fit_run on synthetic run directories with planted exponents and site kinds."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peakprobe.fits import FitError, fit_run, format_summary, make_synthetic_run
from peakprobe.fits.classify import bottleneck

THIRD = 1.0 / 3.0
STEPS = tuple(sorted({0, *np.unique(np.round(np.logspace(1, 4, 40)).astype(int))}))
# the columns of fits.parquet as docs/architecture.md lists them
EXPECTED_COLUMNS = [
    ("fit", pa.string()), ("site_kind", pa.string()), ("layer", pa.int64()),
    ("head", pa.int64()), ("metric", pa.string()), ("time_axis", pa.string()),
    ("t_min", pa.float64()), ("t_max", pa.float64()), ("n_points", pa.int64()),
    ("alpha", pa.float64()), ("alpha_lo", pa.float64()), ("alpha_hi", pa.float64()),
    ("c", pa.float64()), ("L0", pa.float64()), ("L0_lo", pa.float64()), ("L0_hi", pa.float64()),
    ("r2", pa.float64()), ("monotone", pa.bool_()), ("flags", pa.string()),
    ("first_value", pa.float64()), ("final_value", pa.float64()), ("site_class", pa.string()),
    ("sensitivity", pa.float64()),
]
PLANTED_ALPHAS = {(0, 0): 0.25, (0, 3): 0.45, (0, 2): 0.2, (1, 0): THIRD, (1, 3): THIRD,
                  (1, 5): 0.1}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    truth = make_synthetic_run(run_dir, n_layers=2, n_heads=6, steps=STEPS, seed=1,
                               alphas=PLANTED_ALPHAS, noise=0.01)
    return truth, fit_run(run_dir, seed=3)


def test_fits_parquet_matches_the_contract(planted) -> None:
    truth, rf = planted
    table = pq.read_table(truth.run_dir / "fits.parquet")
    assert [(f.name, f.type) for f in table.schema] == EXPECTED_COLUMNS
    df = table.to_pandas()
    # one growth row per (site, fitted metric) and one loss row
    assert (df["fit"] == "loss").sum() == 1
    loss = df[df["fit"] == "loss"].iloc[0]
    assert (loss["site_kind"], loss["layer"], loss["head"], loss["metric"]) == (
        "lm_head", -1, -1, "loss")
    attn = df[(df["fit"] == "growth") & (df["site_kind"] == "attn")]
    assert len(attn) == 12 * 5  # 12 heads x (3 logit magnitudes, max_prob, entropy)
    assert set(attn["metric"]) == {"logit_std", "logit_max_minus_mean", "logit_top_gap",
                                   "max_prob", "entropy"}
    keys = list(zip(df["fit"], df["site_kind"], df["layer"], df["head"], df["metric"],
                    strict=True))
    assert keys == sorted(keys)
    assert (df["time_axis"] == "tau").all()
    assert df.loc[df["fit"] == "growth", "L0"].isna().all()
    # growth rows carry a class only for logit_std
    assert (df.loc[df["metric"] != "logit_std", "site_class"] == "").all()
    # first / final values are the run's first and last checkpoints (step 0 and step 10000)
    std00 = df[(df["metric"] == "logit_std") & (df["layer"] == 0) & (df["head"] == 0)].iloc[0]
    assert std00["first_value"] == 0.0
    c0 = math.sqrt(2 * math.log(256))
    assert std00["final_value"] == pytest.approx(1.6 * c0, rel=0.05)


def test_default_window_drops_warmup(planted) -> None:
    truth, rf = planted
    # rule: t > 0 and step >= 1% of the last step (100); reference counted from the steps
    in_window = [s for s in STEPS if s >= 100]
    assert rf.n_points == len(in_window)
    assert (rf.t_min, rf.t_max) == (float(in_window[0]), float(in_window[-1]))
    loss = rf.table[rf.table["fit"] == "loss"].iloc[0]
    assert loss["n_points"] == len(in_window) and loss["t_min"] == in_window[0]


def test_planted_exponents_are_recovered(planted) -> None:
    truth, rf = planted
    std = rf.table[(rf.table["metric"] == "logit_std") & (rf.table["site_kind"] == "attn")]
    for (layer, head), alpha in truth.alphas.items():
        if truth.kinds[(layer, head)] == "saturated":
            continue  # not a power law
        row = std[(std["layer"] == layer) & (std["head"] == head)].iloc[0]
        assert abs(row["alpha"] - alpha) < 0.02, (layer, head)
        assert row["alpha_lo"] - 0.01 <= alpha <= row["alpha_hi"] + 0.01
    # logit_max_minus_mean and logit_top_gap are planted proportional to logit_std
    gap = rf.table[(rf.table["metric"] == "logit_top_gap") & (rf.table["layer"] == 1)
                   & (rf.table["head"] == 0)].iloc[0]
    assert abs(gap["alpha"] - THIRD) < 0.02
    loss = rf.loss
    assert loss.alpha_lo <= THIRD <= loss.alpha_hi and abs(loss.alpha - THIRD) < 0.05
    assert loss.third_in_ci and loss.third_distance_ci <= 1.0
    assert abs(loss.L0 - truth.loss_L0) < 0.1


def test_planted_site_kinds_are_classified(planted) -> None:
    truth, rf = planted
    got = {(int(r.layer), int(r.head)): r.site_class
           for r in rf.sites.itertuples() if r.site_kind == "attn"}
    assert got == truth.kinds
    lm = rf.sites[rf.sites["site_kind"] == "lm_head"].iloc[0]
    assert lm["site_class"] == truth.lm_head_kind == "saturated"
    b = rf.verdict["bottleneck"]
    planted_counts = {k: list(truth.kinds.values()).count(k) for k in
                      ("concentrating", "saturated", "diffuse")}
    assert (b["n_concentrating"], b["n_saturated"], b["n_diffuse"]) == (
        planted_counts["concentrating"], planted_counts["saturated"], planted_counts["diffuse"])
    assert b["verdict"] == "attention"
    # top sites: the concentrating heads (most negative planted sensitivity) come first
    top = [(s["layer"], s["head"]) for s in b["top_sites"][:planted_counts["concentrating"]]]
    assert set(top) == {k for k, v in truth.kinds.items() if v == "concentrating"}


def test_fits_json_matches_the_contract(planted) -> None:
    truth, rf = planted
    doc = json.loads((truth.run_dir / "fits.json").read_text())
    assert set(doc) == {"format", "time_axis", "loss", "bottleneck", "flags"}
    assert doc["format"] == 1 and doc["time_axis"] == "tau"
    assert set(doc["loss"]) == {"alpha", "alpha_lo", "alpha_hi", "L0", "third_in_ci",
                                "third_distance_ci"}
    assert set(doc["bottleneck"]) == {"verdict", "reason", "n_concentrating", "n_saturated",
                                      "n_diffuse", "lm_head_alpha", "attn_alpha_median",
                                      "top_sites"}
    assert set(doc["bottleneck"]["top_sites"][0]) == {"site_kind", "layer", "head", "alpha",
                                                      "sensitivity"}
    assert doc["loss"]["alpha"] == pytest.approx(rf.loss.alpha)
    assert doc["flags"] == []


def test_same_results_give_the_same_bytes(planted, tmp_path) -> None:
    truth, _ = planted
    first = {n: (truth.run_dir / n).read_bytes() for n in ("fits.parquet", "fits.json")}
    fit_run(truth.run_dir, seed=3)
    assert first == {n: (truth.run_dir / n).read_bytes() for n in ("fits.parquet", "fits.json")}


def test_summary_states_loss_exponent_and_verdict(planted) -> None:
    _, rf = planted
    text = format_summary(rf)
    assert f"alpha {rf.loss.alpha:.3f} [{rf.loss.alpha_lo:.3f}, {rf.loss.alpha_hi:.3f}]" in text
    assert "1/3 inside" in text and "bottleneck: attention" in text


def test_lm_head_bottleneck_is_detected(tmp_path) -> None:
    kinds = {(0, h): ("saturated" if h % 2 else "diffuse") for h in range(4)}
    make_synthetic_run(tmp_path, 1, 4, STEPS, seed=2, kinds=kinds, lm_head_kind="concentrating",
                       noise=0.01)
    rf = fit_run(tmp_path, n_boot=200)
    lm = rf.sites[rf.sites["site_kind"] == "lm_head"].iloc[0]
    assert lm["site_class"] == "concentrating"
    assert abs(lm["alpha_late"] - THIRD) < 0.03
    # planted sensitivities: LM head -0.01, saturated heads -0.002, diffuse 0
    assert rf.verdict["bottleneck"]["verdict"] == "lm_head"


def test_conflicting_growth_without_sensitivity_is_undetermined(tmp_path) -> None:
    make_synthetic_run(tmp_path, 1, 3, STEPS, seed=4, lm_head_kind="concentrating",
                       sensitivity=False, noise=0.01)
    rf = fit_run(tmp_path, n_boot=200)
    b = rf.verdict["bottleneck"]
    assert b["verdict"] == "undetermined"  # attention head 0 and the LM head both concentrate
    assert b["n_concentrating"] == 1
    assert "no_sensitivity" in rf.verdict["flags"]
    assert rf.table["sensitivity"].isna().all()


def test_unknown_tau_falls_back_to_steps(tmp_path) -> None:
    make_synthetic_run(tmp_path, 1, 3, STEPS, seed=5, with_tau=False)
    rf = fit_run(tmp_path, n_boot=50)
    assert rf.time_axis == "step" and (rf.table["time_axis"] == "step").all()
    with pytest.raises(FitError, match="time_axis='step'"):
        fit_run(tmp_path, time_axis="tau", n_boot=50)
    with pytest.raises(FitError, match="time_axis must be"):
        fit_run(tmp_path, time_axis="tokens", n_boot=50)


def test_explicit_window_is_respected(tmp_path) -> None:
    make_synthetic_run(tmp_path, 1, 3, STEPS, seed=6)
    rf = fit_run(tmp_path, t_min=30.0, t_max=3000.0, n_boot=50)
    expected = [s for s in STEPS if 30 <= s <= 3000]
    assert rf.n_points == len(expected)
    assert (rf.table["t_min"] >= 30.0).all() and (rf.table["t_max"] <= 3000.0).all()
    assert (rf.table["n_points"] == len(expected)).all()


def test_too_few_checkpoints_is_a_clear_error(tmp_path) -> None:
    make_synthetic_run(tmp_path, 1, 3, (0, 10, 100, 1000, 10000), seed=7)
    with pytest.raises(FitError, match="only 3 checkpoints fall in the fit window"):
        fit_run(tmp_path, n_boot=50)


def test_missing_points_are_dropped_not_fatal(tmp_path) -> None:
    """A metric absent from some checkpoints is fitted on the rest and flagged."""
    import pandas as pd

    from peakprobe import results

    make_synthetic_run(tmp_path, 1, 3, STEPS, seed=8, noise=0.0)
    victim = results.checkpoint_path(tmp_path, f"step{STEPS[-3]}")
    frame = pq.read_table(victim).to_pandas()
    frame = frame[~((frame["metric"] == "logit_std") & (frame["head"] == 0))]
    results.write_checkpoint(tmp_path, f"step{STEPS[-3]}", pd.DataFrame(frame))
    rf = fit_run(tmp_path, n_boot=50)
    row = rf.table[(rf.table["metric"] == "logit_std") & (rf.table["head"] == 0)].iloc[0]
    assert "dropped_points" in row["flags"] and row["n_points"] == rf.n_points - 1
    assert abs(row["alpha"] - THIRD) < 1e-6


def test_fits_never_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, peakprobe.fits; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _sites(n_heads: int, head_sens: float, lm_sens: float) -> pd.DataFrame:
    rows = [("attn", 0, h, 0.0, "diffuse", head_sens) for h in range(n_heads)]
    rows.append(("lm_head", -1, -1, 0.0, "diffuse", lm_sens))
    return pd.DataFrame(rows, columns=["site_kind", "layer", "head", "alpha_late", "site_class",
                                       "sensitivity"])


@pytest.mark.parametrize(("n_heads", "verdict"), [(8, "attention"), (4, "lm_head")])
def test_sensitivity_compares_kinds_by_one_shared_temperature(n_heads, verdict) -> None:
    # Each head alone (-0.002) is weaker than the LM head (-0.01); one temperature over all heads
    # is the sum: -0.016 with 8 heads (attention wins), -0.008 with 4 (the LM head wins).
    b = bottleneck(_sites(n_heads, -0.002, -0.01))
    assert b["verdict"] == verdict
    assert f"all {n_heads} attention heads together {-0.002 * n_heads:.4g}" in b["reason"]


def test_no_negative_sensitivity_gives_no_answer() -> None:
    b = bottleneck(_sites(4, 0.001, 0.0))
    assert b["verdict"] == "undetermined" and "no signal decides" in b["reason"]
