"""fit_run on raw synthetic runs (tests/helpers/synthetic.py) whose laws, peakedness, gains and
bottleneck are planted: the verdicts must come out as planted."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.synthetic import make_run, pythia_like_steps

from peakprobe import results, vocab
from peakprobe.config import FitConfig
from peakprobe.fits import FitError, fit_run, format_fits, judge_third
from peakprobe.vocab import PeakprobeError

THIRD = 1.0 / 3.0
STEPS = tuple(sorted({0, *np.unique(np.round(np.logspace(1, 4, 40)).astype(int))}))
NB = 200  # bootstrap resamples in these tests
# the columns of fits.parquet as docs/architecture.md lists them
F, S, N, B = pa.float64(), pa.string(), pa.int64(), pa.bool_()
EXPECTED_COLUMNS = [
    ("fit", S), ("site_kind", S), ("layer", N), ("head", N), ("metric", S), ("time_axis", S),
    ("t_min", F), ("t_max", F), ("n_points", N), ("alpha", F), ("alpha_lo", F), ("alpha_hi", F),
    ("c", F), ("L0", F), ("L0_lo", F), ("L0_hi", F), ("r2", F), ("monotone", B), ("flags", S),
    ("first_value", F), ("final_value", F), ("verdict", S), ("band_lo", F), ("band_hi", F),
    ("third_in_ci", B), ("peaked", B), ("site_class", S), ("alpha_late", F),
    ("alpha_late_lo", F), ("alpha_late_hi", F), ("p_growing", F), ("q_growing", F),
    ("share", F), ("share_lo", F), ("share_hi", F), ("p_share", F), ("q_share", F),
    ("sensitivity", F),
]
PLANTED_ALPHAS = {(0, 0): 0.25, (0, 3): 0.45, (0, 2): 0.2, (1, 0): THIRD, (1, 3): THIRD,
                  (1, 5): 0.1}


def _row(table: pd.DataFrame, fit: str, kind: str, layer: int, head: int, metric: str):
    sel = table[(table["fit"] == fit) & (table["site_kind"] == kind) & (table["layer"] == layer)
                & (table["head"] == head) & (table["metric"] == metric)]
    assert len(sel) == 1, (fit, kind, layer, head, metric)
    return sel.iloc[0]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Attention bottleneck: concentrating heads carry a gain share decaying as t^-1/3."""
    run_dir = tmp_path_factory.mktemp("run")
    truth = make_run(run_dir, n_layers=2, n_heads=6, steps=STEPS, seed=1, alphas=PLANTED_ALPHAS,
                     noise=0.01, gains="attention")
    return truth, fit_run(run_dir, FitConfig(n_boot=NB, seed=3))


def test_fits_parquet_matches_the_contract(planted) -> None:
    truth, rf = planted
    table = pq.read_table(truth.run_dir / "fits.parquet")
    assert [(f.name, f.type) for f in table.schema] == EXPECTED_COLUMNS
    df = table.to_pandas()
    assert (df["fit"] == "loss").sum() == 1
    attn = df[(df["fit"] == "growth") & (df["site_kind"] == vocab.ATTN)]
    assert len(attn) == 12 * 6  # 12 heads x (3 logit magnitudes, logit_max, max_prob, entropy)
    # one gain row per gain site: 12 heads, 2 layers, all heads, the LM head
    assert (df["fit"] == "gain").sum() == 12 + 2 + 1 + 1
    keys = list(zip(df["fit"], df["site_kind"], df["layer"], df["head"], df["metric"],
                    strict=True))
    assert keys == sorted(keys)
    assert (df["band_lo"] == 0.25).all() and (df["band_hi"] == 0.42).all()
    judged = (df["fit"] != "growth") | df["metric"].isin(vocab.MAGNITUDE_METRICS)
    assert set(df.loc[judged, "verdict"]) <= set(vocab.THIRD_VERDICTS)
    assert (df.loc[~judged, "verdict"] == "").all()
    assert df.loc[df["fit"] != "gain", "share"].isna().all()
    assert df.loc[df["metric"] != "logit_std", "p_growing"].isna().all()


def test_default_window_drops_warmup(planted) -> None:
    truth, rf = planted
    in_window = [s for s in STEPS if s >= 100]  # no fit_start_step, no schedule: 1% of 10000
    assert rf.n_points == len(in_window)
    assert (rf.t_min, rf.t_max) == (float(in_window[0]), float(in_window[-1]))
    assert rf.verdict["window"]["start_rule"].startswith("1% of the last step")


def _check_verdicts(planted: list[tuple[float, pd.Series]]) -> None:
    """Rows fitted to planted exponents: far from 1/3 -> inconsistent; at 1/3 -> consistent,
    except for the ~10% of 90% intervals that miss the truth (then only just)."""
    at_third = []
    for alpha, row in planted:
        assert row["verdict"] == judge_third(row["alpha_lo"], row["alpha_hi"])
        if abs(alpha - THIRD) > 0.05:
            assert row["verdict"] == vocab.INCONSISTENT, (alpha, row["alpha_lo"], row["alpha_hi"])
        else:
            at_third.append(row["verdict"] == vocab.CONSISTENT)
            assert row["alpha_lo"] - 0.005 <= THIRD <= row["alpha_hi"] + 0.005
    assert sum(at_third) >= 0.6 * len(at_third)


def test_planted_growth_exponents_and_three_way_verdicts(planted) -> None:
    truth, rf = planted
    rows = []
    for (layer, head), alpha in truth.alphas.items():
        if truth.kinds[(layer, head)] == "saturated":
            continue  # not a power law
        row = _row(rf.table, "growth", vocab.ATTN, layer, head, "logit_std")
        assert abs(row["alpha"] - alpha) < 0.02, (layer, head)
        rows.append((alpha, row))
    _check_verdicts(rows)
    loss = rf.verdict["loss"]
    assert loss["alpha_lo"] <= THIRD <= loss["alpha_hi"] and loss["verdict"] == vocab.CONSISTENT


def test_planted_gains_are_recovered(planted) -> None:
    truth, rf = planted
    rows = []
    for (kind, layer, head), alpha in truth.gain_alphas.items():
        row = _row(rf.table, "gain", kind, layer, head, vocab.GAIN)
        assert abs(row["alpha"] - alpha) < 0.02, (kind, layer, head)  # decay exponent, > 0
        share = truth.gain_shares[(kind, layer, head)]
        site = rf.sites.set_index(["site_kind", "layer", "head"]).loc[(kind, layer, head)]
        # the share of L - L0 at the window's end, read off the fitted laws
        assert site["share_floor_lo"] * 0.9 <= share <= site["share_floor_hi"] * 1.1, (kind, layer, head)
        # the share of the loss decrease: the slope of the planted G on the planted L
        drop = _drop_truth(truth, rf, share, alpha)
        assert row["share_lo"] - 0.1 * abs(drop) <= drop <= row["share_hi"] + 0.1 * abs(drop), (kind, layer, head)
        rows.append((alpha, row))
    _check_verdicts(rows)


def _drop_truth(truth, rf, share: float, alpha: float) -> float:
    """The planted gain's share of the loss decrease over the fit window:
    (G(t1) - G(t2)) / (L(t1) - L(t2)) of the noiseless laws at the window's ends."""
    t_end = float(max(truth.steps))
    t = np.array([rf.t_min, rf.t_max])
    loss = truth.loss_L0 + truth.loss_c * t ** -truth.loss_alpha
    g = share * truth.loss_c * t_end ** -truth.loss_alpha * (t / t_end) ** -alpha
    return float((g[0] - g[1]) / (loss[0] - loss[1]))


def test_planted_classes_are_recovered_under_bh(planted) -> None:
    truth, rf = planted
    got = {(int(r.layer), int(r.head)): r.site_class
           for r in rf.sites.itertuples() if r.site_kind == vocab.ATTN}
    assert got == truth.kinds
    b = rf.verdict["bottleneck"]
    counts = {k: list(truth.kinds.values()).count(k) for k in ("concentrating", "saturated",
                                                               "diffuse")}
    assert (b["n_concentrating"], b["n_saturated"], b["n_diffuse"]) == (
        counts["concentrating"], counts["saturated"], counts["diffuse"])


def test_planted_attention_bottleneck(planted) -> None:
    truth, rf = planted
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_ATTENTION
    k = b["kinds"][vocab.BOTTLENECK_ATTENTION]
    assert k["site"] == "attention (all heads)" and k["significant"]
    assert k["share_lo"] <= 0.5 <= k["share_hi"]
    assert k["alpha_gain_lo"] - 0.005 <= THIRD <= k["alpha_gain_hi"] + 0.005
    lm = b["kinds"][vocab.BOTTLENECK_LM_HEAD]
    assert lm["share_floor_hi"] < 0.1  # 2% planted share of L - L0 at the end
    # its gain falls faster than the loss, so it explains part of the early decrease; the
    # verdict still names attention, whose gain decays slower
    assert lm["alpha_gain"] > k["alpha_gain"]
    top = [(s["layer"], s["head"]) for s in b["top_sites"] if s["site_kind"] == vocab.ATTN][:4]
    assert set(top) == {k for k, v in truth.kinds.items() if v == "concentrating"}


def test_fits_json_matches_the_contract(planted) -> None:
    truth, rf = planted
    doc = json.loads((truth.run_dir / "fits.json").read_text())
    assert set(doc) == {"format", "band", "ci_level", "time_axis", "window", "excluded",
                        "spikes", "loss", "loss_scan", "skipped", "bottleneck", "flags"}
    assert doc["format"] == 2 and doc["band"] == [0.25, 0.42] and doc["ci_level"] == 0.9
    assert set(doc["loss"]) == {"alpha", "alpha_lo", "alpha_hi", "verdict", "L0", "L0_lo",
                                "L0_hi", "c", "third_in_ci", "n_points", "t_min", "t_max",
                                "flags"}
    assert set(doc["bottleneck"]) == {
        "verdict", "reason", "share_min", "share_of", "fdr", "kinds", "peaked_criteria", "n_heads",
        "n_peaked", "n_concentrating", "n_saturated", "n_diffuse", "n_share_significant",
        "top_sites"}
    # beta_eff's rule where measured (the logit-std flag only for results without it)
    assert doc["bottleneck"]["peaked_criteria"]["attention"] == ["peaked_entropy_xsink"]
    assert set(doc["loss_scan"]) == {"drift", "rows"} and doc["loss_scan"]["rows"]
    assert doc["flags"] == [] and doc["excluded"] == [] and doc["spikes"] == []


def test_same_results_give_the_same_bytes(planted) -> None:
    truth, _ = planted
    first = {n: (truth.run_dir / n).read_bytes() for n in ("fits.parquet", "fits.json")}
    fit_run(truth.run_dir, FitConfig(n_boot=NB, seed=3))
    assert first == {n: (truth.run_dir / n).read_bytes() for n in ("fits.parquet", "fits.json")}


def test_summary_states_verdicts_with_interval_band_and_window(planted) -> None:
    _, rf = planted
    text = format_fits(rf)
    loss = rf.loss
    assert (f"alpha {loss.alpha:.3f} [{loss.alpha_lo:.3f}, {loss.alpha_hi:.3f}] (90% CI) -> "
            f"consistent (band [0.25, 0.42]; window tau 100-10000, {rf.n_points} checkpoints)"
            ) in text
    assert "bottleneck: attention - attention's gain explains" in text


def test_lm_head_bottleneck(tmp_path) -> None:
    kinds = {(0, h): ("saturated" if h % 2 else "diffuse") for h in range(4)}
    truth = make_run(tmp_path, 1, 4, STEPS, seed=2, kinds=kinds, lm_head_kind="concentrating",
                     gains="lm_head")
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_LM_HEAD
    k = b["kinds"][vocab.BOTTLENECK_LM_HEAD]
    assert k["alpha_gain_lo"] - 0.005 <= THIRD <= k["alpha_gain_hi"] + 0.005
    assert k["share_lo"] <= 0.5 <= k["share_hi"]
    assert rf.sites.set_index("site_kind").loc[vocab.LM_HEAD, "site_class"] == "concentrating"


def test_no_peaked_site_means_the_mechanism_does_not_apply(tmp_path) -> None:
    """Like the small Qwen3 run: nothing peaked, 8 checkpoints, a loose loss exponent."""
    kinds = {(layer, h): "diffuse" for layer in range(2) for h in range(4)}
    steps = [0, 18, 30, 50, 80, 130, 200, 300, 439]
    truth = make_run(tmp_path, 2, 4, steps, seed=5, kinds=kinds, lm_head_kind="diffuse",
                     loss_noise=0.02, gain_noise=0.1, gains="attention", fit_start_step=18)
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_NONE
    assert b["reason"].startswith("no softmax is peaked: the 1/3 mechanism does not apply")
    assert b["n_peaked"] == 0 and b["n_concentrating"] == 0
    loss = rf.verdict["loss"]
    assert loss["alpha_hi"] - loss["alpha_lo"] > 0.42 - 0.25  # wider than the band
    assert loss["alpha_lo"] <= THIRD <= loss["alpha_hi"]
    assert loss["verdict"] == vocab.INCONCLUSIVE  # never "consistent"
    gain = _row(rf.table, "gain", vocab.ATTN_ALL, -1, -1, vocab.GAIN)
    assert gain["alpha_lo"] <= THIRD <= gain["alpha_hi"] and gain["verdict"] == vocab.INCONCLUSIVE
    assert "no softmax is peaked" in format_fits(rf)


def test_peaked_by_entropy_only_counts(tmp_path) -> None:
    """Like the tiny Llama: the LM head is near-deterministic (entropy-equivalent beta far above
    sqrt(2 ln n)) while its logit std stays below the threshold; it carries the gain."""
    kinds = {(0, h): "diffuse" for h in range(4)}
    truth = make_run(tmp_path, 1, 4, STEPS, seed=6, kinds=kinds, lm_head_kind="diffuse",
                     lm_beta_eff_factor=4.0, gains="lm_head")
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    lm = rf.sites.set_index("site_kind").loc[vocab.LM_HEAD]
    assert lm["peaked"]
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_LM_HEAD


def test_heads_parked_on_the_sink_are_not_peaked(tmp_path) -> None:
    kinds = {(0, h): "sink" for h in range(4)}
    truth = make_run(tmp_path, 1, 4, STEPS, seed=7, kinds=kinds, lm_head_kind="diffuse",
                     gains="attention")
    raw = results.read_results(tmp_path)
    last = raw[(raw["step"] == STEPS[-1]) & (raw["metric"] == "peaked")
               & (raw["site_kind"] == vocab.ATTN)]
    assert (last["value"] > 0.9).all()  # the raw flag says peaked
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_NONE
    assert b["n_peaked"] == 0


def test_without_gains_the_verdict_is_undetermined(tmp_path) -> None:
    truth = make_run(tmp_path, 1, 3, STEPS, seed=8, gains=None)
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    b = rf.verdict["bottleneck"]
    assert truth.expected_bottleneck == b["verdict"] == vocab.BOTTLENECK_UNDETERMINED
    assert "cannot be computed without gains" in b["reason"]
    assert "no_gain" in rf.verdict["flags"]
    assert (rf.table["fit"] != "gain").all()


def test_an_older_run_is_judged_by_what_it_measured(tmp_path) -> None:
    """No entropy peakedness, no sink-excluded statistics, no gains: the logit-std flag decides
    peakedness, and the bottleneck is not guessed from the (negative) sensitivities."""
    make_run(tmp_path, 1, 3, STEPS, seed=14, gains=None, peaked_entropy=False, xsink=False)
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    b = rf.verdict["bottleneck"]
    assert b["peaked_criteria"] == {"attention": ["peaked"], "lm_head": ["peaked"]}
    assert b["n_peaked"] == 2  # the concentrating and the saturated head
    assert b["verdict"] == vocab.BOTTLENECK_UNDETERMINED
    assert "cannot be computed without gains" in b["reason"]
    assert rf.sites["sensitivity"].min() < -0.01  # measured, and not used
    assert b["kinds"]["attention"]["share"] is None and b["kinds"]["attention"]["gain_verdict"] is None


def test_nothing_peaked_by_logit_std_alone_is_not_none(tmp_path) -> None:
    kinds = {(0, h): "diffuse" for h in range(3)}
    make_run(tmp_path, 1, 3, STEPS, seed=15, kinds=kinds, lm_head_kind="diffuse",
             peaked_entropy=False)
    b = fit_run(tmp_path, FitConfig(n_boot=50)).verdict["bottleneck"]
    assert b["verdict"] == vocab.BOTTLENECK_UNDETERMINED and "no peaked_entropy" in b["reason"]


def test_many_null_heads_do_not_make_a_verdict(tmp_path) -> None:
    """40 peaked heads, each with a true gain share exactly at the threshold (the null's edge)
    and noise: unadjusted one-sided tests call some of them large; Benjamini-Hochberg calls
    none, so no verdict is drawn from them."""
    kinds = {(layer, h): "concentrating" for layer in range(4) for h in range(10)}
    head_gains = {k: (vocab.GAIN_SHARE_MIN, THIRD) for k in kinds}
    truth = make_run(tmp_path, 4, 10, STEPS, seed=11, kinds=kinds, head_gains=head_gains,
                     gain_groups=False, gain_noise=0.05, lm_head_kind="diffuse",
                     gains="attention")
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    gains = rf.table[(rf.table["fit"] == "gain") & (rf.table["site_kind"] == vocab.ATTN)]
    assert (gains["p_share"] <= vocab.FDR).sum() >= 1  # what a count without control sees
    assert not (gains["q_share"] <= vocab.FDR).any()
    b = rf.verdict["bottleneck"]
    assert b["verdict"] == vocab.BOTTLENECK_UNDETERMINED  # the LM head's share: not peaked
    assert "no peaked softmax's gain explains a significant share" in b["reason"]
    assert "ranks first is outside what it measures" in b["reason"]  # attention is peaked
    assert truth.expected_bottleneck == vocab.BOTTLENECK_ATTENTION  # the naive answer


def test_pythia_default_window_and_user_steps(tmp_path) -> None:
    steps = pythia_like_steps(40)
    for start in (512, 256):
        run = tmp_path / str(start)
        make_run(run, 1, 3, steps, seed=9, family="pythia", fit_start_step=start)
        rf = fit_run(run, FitConfig(n_boot=50))
        want = min(s for s in steps if s >= start)
        assert rf.step_min == want and rf.verdict["window"]["step_min"] == want
        assert rf.verdict["window"]["start_rule"] == f"manifest fit_start_step {start}"
    rf = fit_run(run, FitConfig(n_boot=50, t_min_step=2000, t_max_step=100000))
    assert (rf.step_min, rf.step_max) == (2000, max(s for s in steps if s <= 100000))
    assert rf.verdict["window"]["start_rule"] == "user"


def test_loss_scan_flags_drift(tmp_path) -> None:
    # L = 2 + c t^-1/3 + c2 t^-1: the fast term dominates early, so alpha(t_min) falls
    make_run(tmp_path / "drift", 1, 3, STEPS, seed=10, loss_c2=200.0, loss_noise=0.002)
    rf = fit_run(tmp_path / "drift", FitConfig(n_boot=NB))
    scan = rf.verdict["loss_scan"]
    assert scan["drift"] and "loss_alpha_drift" in rf.verdict["flags"]
    assert scan["rows"][0]["alpha"] > scan["rows"][-1]["alpha"]
    assert any(r["drift"] for r in scan["rows"])
    for r in scan["rows"]:
        assert r["n_points"] >= 10 and 30 * r["t_min"] <= rf.t_max
    make_run(tmp_path / "pure", 1, 3, STEPS, seed=10, loss_noise=0.002)
    rf = fit_run(tmp_path / "pure", FitConfig(n_boot=NB))
    assert not rf.verdict["loss_scan"]["drift"] and len(rf.verdict["loss_scan"]["rows"]) >= 3


def test_duplicates_are_excluded_and_spikes_flagged(tmp_path) -> None:
    window = [s for s in STEPS if s >= 100]
    dup, spike = window[3], STEPS[-15]  # an early checkpoint serving the final weights
    make_run(tmp_path, 1, 3, STEPS, seed=12, duplicates={f"step{dup}": f"step{STEPS[-1]}"},
             spikes={spike: 1.06}, loss_noise=0.002)
    rf = fit_run(tmp_path, FitConfig(n_boot=NB))
    doc = rf.verdict
    assert [e["revision"] for e in doc["excluded"]] == [f"step{dup}"]
    assert doc["excluded"][0]["duplicates"] == [f"step{STEPS[-1]}"]
    assert rf.n_points == len(window) - 1
    assert [s["step"] for s in doc["spikes"]] == [spike]
    assert {"excluded_duplicates", "loss_spike"} <= set(doc["flags"])
    assert abs(doc["loss"]["alpha"] - THIRD) < 0.02
    (tmp_path / vocab.INTEGRITY).unlink()  # without the integrity file the copy is fitted
    kept = fit_run(tmp_path, FitConfig(n_boot=20))
    assert kept.n_points == len(window) and kept.verdict["excluded"] == []
    assert dup in [s["step"] for s in kept.verdict["spikes"]]  # the copy dips below both


def test_band_option_changes_the_verdict(planted, tmp_path) -> None:
    truth, rf = planted
    narrow = fit_run(truth.run_dir, FitConfig(n_boot=NB, seed=3, band=(0.333, 0.334)))
    assert narrow.verdict["band"] == [0.333, 0.334]
    assert narrow.verdict["loss"]["verdict"] == vocab.INCONCLUSIVE
    assert (narrow.table["band_lo"] == 0.333).all()
    assert "band [0.333, 0.334]" in format_fits(narrow)
    with pytest.raises(PeakprobeError, match="must contain 1/3"):
        fit_run(truth.run_dir, FitConfig(n_boot=10, band=(0.4, 0.5)))
    fit_run(truth.run_dir, FitConfig(n_boot=NB, seed=3))  # leave the module fixture's files as they were


def test_failed_checkpoints_are_flagged(tmp_path) -> None:
    make_run(tmp_path, 1, 3, STEPS, seed=13)
    results.append_failure(tmp_path, {"revision": "step99999", "error": "boom"})
    assert "failed_checkpoints" in fit_run(tmp_path, FitConfig(n_boot=20)).verdict["flags"]


def test_unknown_tau_falls_back_to_steps(tmp_path) -> None:
    make_run(tmp_path, 1, 3, STEPS, seed=5, with_tau=False)
    rf = fit_run(tmp_path, FitConfig(n_boot=50))
    assert rf.time_axis == "step" and (rf.table["time_axis"] == "step").all()
    with pytest.raises(FitError, match="time_axis='step'"):
        fit_run(tmp_path, FitConfig(time_axis="tau", n_boot=50))
    with pytest.raises(PeakprobeError, match="time axis must be"):
        fit_run(tmp_path, FitConfig(time_axis="tokens", n_boot=50))


def test_explicit_window_is_respected(tmp_path) -> None:
    make_run(tmp_path, 1, 3, STEPS, seed=6)
    rf = fit_run(tmp_path, FitConfig(t_min=30.0, t_max=3000.0, n_boot=50))
    expected = [s for s in STEPS if 30 <= s <= 3000]
    assert rf.n_points == len(expected)
    assert (rf.table["t_min"] >= 30.0).all() and (rf.table["t_max"] <= 3000.0).all()
    assert rf.verdict["window"]["start_rule"] == "user"


def test_too_few_checkpoints_skip_the_fits_that_need_more(tmp_path) -> None:
    """Three checkpoints in the window: the growth and loss fits are skipped and listed with the
    option that widens the window; one checkpoint: nothing can be fitted, a clear error."""
    make_run(tmp_path, 1, 3, (0, 10, 100, 1000, 10000), seed=7)
    rf = fit_run(tmp_path, FitConfig(n_boot=50))
    assert [(s["fit"], s["n_points"]) for s in rf.skipped] == [("growth", 3), ("loss", 3)]
    assert all("--t-min-step 10" in s["reason"] for s in rf.skipped)
    assert rf.loss is None and rf.verdict["skipped"] == rf.skipped
    with pytest.raises(FitError, match="only 1 checkpoints fall in the fit window"):
        fit_run(tmp_path, FitConfig(n_boot=50, t_min_step=10000))


def test_missing_points_are_dropped_not_fatal(tmp_path) -> None:
    """A metric absent from some checkpoints is fitted on the rest and flagged."""
    make_run(tmp_path, 1, 3, STEPS, seed=8, noise=0.0, loss_noise=0.0)
    victim = results.checkpoint_path(tmp_path, f"step{STEPS[-3]}")
    frame = pq.read_table(victim).to_pandas()
    frame = frame[~((frame["metric"] == "logit_std") & (frame["head"] == 0))]
    results.write_checkpoint(tmp_path, f"step{STEPS[-3]}", pd.DataFrame(frame))
    rf = fit_run(tmp_path, FitConfig(n_boot=50))
    row = _row(rf.table, "growth", vocab.ATTN, 0, 0, "logit_std")
    assert "dropped_points" in row["flags"] and row["n_points"] == rf.n_points - 1
    assert abs(row["alpha"] - THIRD) < 1e-6


def test_fits_never_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, peakprobe.fits; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bh_qvalues_match_a_direct_count() -> None:
    from peakprobe.fits.common import bh_qvalues

    rng = np.random.default_rng(0)
    p = np.concatenate([rng.uniform(0, 1, 30), rng.uniform(0, 0.002, 5), [np.nan]])
    q = bh_qvalues(p)
    m = 35
    for level in (0.05, 0.1, 0.2):  # BH step-up: reject the k smallest, k = max{i: p_(i) <= i q / m}
        ps = np.sort(p[:-1])
        k = max([i + 1 for i in range(m) if ps[i] <= (i + 1) * level / m], default=0)
        assert int((q <= level).sum()) == k
    assert math.isnan(q[-1])


def test_gain_shares_divide_by_the_loss_on_the_gains_own_windows(tmp_path) -> None:
    """Where the run records the loss on the attribution windows (``attribution_loss``), a
    gain's share of the loss decrease divides by that loss's law, not the run's: planted, the
    attention gain is the whole excess of the attribution windows' loss (share 1) while it is a
    fraction of the run's; the share recovers 1, and without the rows the run's fraction."""
    truth = make_run(tmp_path, n_layers=2, n_heads=6, steps=STEPS, seed=1, alphas=PLANTED_ALPHAS,
                     noise=0.01, gains="attention", gain_noise=0.0)
    key = (vocab.ATTN_ALL, -1, -1)
    before_fit = fit_run(tmp_path, FitConfig(n_boot=NB, seed=3))
    before = before_fit.sites.set_index(["site_kind", "layer", "head"]).loc[key]
    drop = _drop_truth(truth, before_fit, truth.gain_shares[key], truth.gain_alphas[key])
    assert abs(before["share"] - drop) < 0.1 * abs(drop) and abs(drop - 1) > 0.3
    for path in sorted((tmp_path / results.CHECKPOINTS).glob("*.parquet")):
        df = results.read_checkpoint(path)
        gain = df[(df.site_kind == vocab.ATTN_ALL) & (df.metric == vocab.GAIN)]
        row = df[(df.site_kind == vocab.LM_HEAD) & (df.metric == vocab.LOSS)].copy()
        row["metric"], row["value"] = vocab.ATTRIBUTION_LOSS, 3.0 + float(gain["value"].iloc[0])
        results.write_checkpoint(tmp_path, str(df["revision"].iloc[0]), pd.concat([df, row]))
    after = fit_run(tmp_path, FitConfig(n_boot=NB, seed=3))
    site = after.sites.set_index(["site_kind", "layer", "head"]).loc[key]
    assert abs(site["share"] - 1.0) < 0.05 and site["share_lo"] <= 1.0 <= site["share_hi"] + 0.02
    assert after.loss.L0 == pytest.approx(before_fit.loss.L0)  # the run's own law is unchanged


def test_the_lm_heads_share_reads_its_gain_after_attention(tmp_path) -> None:
    """Where the run records the LM head's gain after attention, its gain fit and share read
    that series: planted, the LM head's own gain carries much of the decrease (share above 0.3)
    while after attention it is a constant 0.001 nats (share 0); the verdict names the series."""
    make_run(tmp_path, n_layers=2, n_heads=6, steps=STEPS, seed=1, alphas=PLANTED_ALPHAS,
             noise=0.01, gains="lm_head", gain_noise=0.0)
    key = (vocab.LM_HEAD, -1, -1)
    alone = fit_run(tmp_path, FitConfig(n_boot=NB, seed=3)).sites.set_index(
        ["site_kind", "layer", "head"]).loc[key]
    assert alone["share_lo"] > 0.3
    for path in sorted((tmp_path / results.CHECKPOINTS).glob("*.parquet")):
        df = results.read_checkpoint(path)
        row = df[(df.site_kind == vocab.LM_HEAD) & (df.metric == vocab.GAIN)].copy()
        row["metric"], row["value"] = vocab.GAIN_AFTER_ATTENTION, 1e-3
        results.write_checkpoint(tmp_path, str(df["revision"].iloc[0]), pd.concat([df, row]))
    after = fit_run(tmp_path, FitConfig(n_boot=NB, seed=3))
    site = after.sites.set_index(["site_kind", "layer", "head"]).loc[key]
    assert abs(site["share"]) < 0.01 and site["gain_metric"] == vocab.GAIN_AFTER_ATTENTION
    gain_fits = after.table[(after.table["fit"] == vocab.FIT_GAIN) & (after.table["site_kind"] == vocab.LM_HEAD)]
    assert list(gain_fits["metric"]) == [vocab.GAIN_AFTER_ATTENTION]
    kinds = results.read_json(tmp_path / results.FITS_JSON)["bottleneck"]["kinds"]
    assert kinds[vocab.BOTTLENECK_LM_HEAD]["site"] == "LM head after attention"
