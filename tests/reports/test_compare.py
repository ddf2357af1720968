"""The comparison report: a planted family of four sizes through fitted run directories and
through an external curve file recovers the planted loss exponents within 0.01; the page passes
the headless-browser checks of report.html (reusing tests/reports/test_report_browser.py's machinery)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from peakprobe import api, cli, results
from peakprobe.config import CurveConfig, FitConfig
from peakprobe.fits import fit_run
from peakprobe.fits.third import judge_third
from peakprobe.probes.gaussian_entropy import peaked_threshold
from peakprobe.vocab import THIRD

N_BOOT = 60
STEPS = tuple([2**i for i in range(4, 10)] + list(range(1000, 20001, 1000)))
# size -> (parameters, planted loss exponent, layers, heads)
FAMILY = {"s1": (1.0e7, 0.28, 2, 3), "s2": (4.0e7, THIRD, 3, 3), "s3": (1.6e8, 0.38, 4, 3),
          "s4": (6.4e8, 0.45, 4, 4)}
EVIL = "<script>alert(1)</script>"


def planted_run(run_dir, model: str, n_layers: int, n_heads: int, *, loss_alpha: float = THIRD,
                L0: float = 2.0, noise: float = 1e-3, seed: int = 0, n_params: float | None = None):
    """A raw run directory (what a sweep writes) with planted laws: every attention head's
    logit_std grows as t^(1/3) past the peaked threshold, the LM head's stays flat and the
    loss is L0 + c t^-loss_alpha with a reducible part of L0 / 4 at the last step; tau = step.
    Every value gets multiplicative noise (1 + noise N(0, 1))."""
    rng = np.random.default_rng(seed)
    t = np.array(STEPS, dtype=float)
    c0_attn, c0_lm = peaked_threshold(64), peaked_threshold(1000)
    sites = {}
    for layer in range(n_layers):
        for head in range(n_heads):
            beta = 1.6 * c0_attn * (t / t[-1]) ** THIRD * (1 + 0.1 * head)
            sites[("attn", layer, head)] = {"logit_std": beta, "peaked": np.ones_like(t),
                                            "entropy": np.log(64) * np.exp(-beta / c0_attn),
                                            "max_prob": 1 - np.exp(-beta / c0_attn)}
    loss = L0 + 0.25 * L0 * (t / t[-1]) ** -loss_alpha
    sites[("lm_head", -1, -1)] = {"logit_std": np.full_like(t, 0.5 * c0_lm),
                                  "peaked": np.zeros_like(t), "loss": loss,
                                  "entropy": loss, "max_prob": np.exp(-loss)}
    checkpoints = []
    for j, step in enumerate(STEPS):
        rows = [{"model": model, "revision": f"step{step}", "step": step, "tokens": step * 1000,
                 "tau": float(step), "site_kind": kind, "layer": layer, "head": head,
                 "metric": name, "n_rows": 512,
                 "value": float(v[j] * (1 if name == "peaked" else 1 + noise * rng.standard_normal()))}
                for (kind, layer, head), metrics in sites.items() for name, v in sorted(metrics.items())]
        results.write_checkpoint(run_dir, f"step{step}", pd.DataFrame(rows))
        checkpoints.append({"revision": f"step{step}", "step": step, "tokens": step * 1000,
                            "tau": float(step), "path": None})
    manifest = {"format": results.FORMAT, "model": model, "source": "planted",
                "checkpoints": checkpoints, "data": {"spec": "planted"}, "probe": {},
                "versions": {}}
    if n_params is not None:
        manifest["n_parameters"] = n_params  # planted runs have no weights to count
    results.write_json(run_dir / results.MANIFEST, manifest)
    return run_dir


def _family_runs(base, evil_last: bool = False) -> list:
    runs = []
    for i, (name, (n_params, alpha, n_layers, n_heads)) in enumerate(FAMILY.items()):
        model = EVIL if evil_last and i == len(FAMILY) - 1 else name
        run = planted_run(base / name, model, n_layers, n_heads, loss_alpha=alpha,
                          L0=2.6 - 0.2 * i, seed=i, n_params=n_params)
        fit_run(run, FitConfig(n_boot=N_BOOT))
        runs.append(run)
    return runs


NAMES = [*list(FAMILY)[:-1], EVIL]  # the largest member carries a hostile model name


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    base = tmp_path_factory.mktemp("family")
    runs = _family_runs(base, evil_last=True)
    paths = api.compare(runs, base / "cmp", fit=FitConfig(n_boot=N_BOOT), command="peakprobe compare ...")
    return runs, paths


def test_run_dirs_recover_planted_exponents(family):
    runs, paths = family
    table = pd.read_csv(paths.members_csv)
    assert list(table["member"]) == NAMES  # ordered by size
    for row, (n_params, alpha, _, _) in zip(table.itertuples(), FAMILY.values(), strict=True):
        assert abs(row.alpha - alpha) < 0.01, (row.member, row.alpha, alpha)
        assert row.alpha_lo <= row.alpha <= row.alpha_hi
        assert row.verdict == judge_third(row.alpha_lo, row.alpha_hi)
        assert row.n_params == n_params and row.n_params_from == "manifest"
        assert isinstance(row.bottleneck, str) and row.bottleneck  # from each run's fits.json
    summary = json.loads(paths.members_json.read_text())
    assert summary["x_axis"] == "tau" and summary["band"] == [0.25, 0.42]
    assert [m["member"] for m in summary["members"]] == NAMES


def test_growth_against_relative_depth(family):
    _, paths = family
    growth = pd.read_csv(paths.growth_csv)
    for name, (_, _, n_layers, n_heads) in zip(NAMES, FAMILY.values(), strict=True):
        g = growth[growth["member"] == name]
        assert len(g) == n_layers * n_heads
        np.testing.assert_allclose(g["rel_depth"], (g["layer"] + 1) / n_layers)
    assert (abs(growth["alpha"] - THIRD) < 0.01).all()  # every head planted as t^(1/3)
    # 90% intervals: about one head in ten misses the planted 1/3 by chance
    assert (growth["verdict"] == "consistent").mean() >= 0.75
    assert set(growth["verdict"]) <= {"consistent", "inconsistent", "inconclusive"}
    for name in ("loss_overlay", "reducible", "exponent_vs_size", "growth_vs_depth", "window_scan"):
        assert (paths.out_dir / "figures" / f"{name}.svg").stat().st_size > 1000


def test_external_curve_file_recovers_planted_exponents(tmp_path):
    t = np.array(STEPS, dtype=float)
    rows = []
    for i, (name, (n_params, alpha, _, _)) in enumerate(FAMILY.items()):
        rng = np.random.default_rng(10 + i)
        loss = (2.6 - 0.2 * i + 0.5 * (2.6 - 0.2 * i) * (t / t[-1]) ** -alpha) * (
            1 + 1e-3 * rng.standard_normal(t.shape))
        rows += [{"model": name, "step": int(s), "loss": float(v), "n_params": n_params}
                 for s, v in zip(t, loss, strict=True)]
    path = tmp_path / "family.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    paths = api.compare([path], tmp_path / "cmp", fit=FitConfig(n_boot=N_BOOT, t_min_step=16),
                        curve=CurveConfig(scan=False))
    table = pd.read_csv(paths.members_csv)
    assert list(table["member"]) == list(FAMILY)
    for row in table.itertuples():
        assert abs(row.alpha - FAMILY[row.member][1]) < 0.01, (row.member, row.alpha)
        assert row.n_params == FAMILY[row.member][0] and row.kind == "curve"
    page = paths.html.read_text()
    assert "bottleneck-missing" in page  # curves carry no bottleneck verdict: said, not blank


def test_cli_compare_errors_are_one_line(tmp_path, capsys):
    run = planted_run(tmp_path / "unfitted", "m", 1, 2)
    assert cli.main(["-q", "compare", str(run), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run `peakprobe fit" in err[0]
    assert cli.main(["-q", "compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert cli.main(["-q", "compare", str(run), "--out", str(tmp_path / "o"), "--band", "0.4,0.5"]) == 2


def test_fits_json_without_bottleneck_degrades(tmp_path):
    run = planted_run(tmp_path / "r", "bare", 2, 3)
    fit_run(run, FitConfig(n_boot=N_BOOT))
    (run / results.FITS_JSON).write_text(json.dumps({"format": 1}))  # keys another version lacks
    paths = api.compare([run], tmp_path / "cmp", fit=FitConfig(n_boot=N_BOOT), curve=CurveConfig(scan=False))
    row = pd.read_csv(paths.members_csv).iloc[0]
    assert math.isfinite(row["alpha"]) and pd.isna(row["bottleneck"])
    assert "<td class=\"t\"><b>—</b></td>" in paths.html.read_text()


# -- the headless-browser checks of report.html, on compare.html -----------------------------------
@pytest.fixture(scope="module")
def page(family):
    from helpers.browser import open_page

    paths = family[1]
    base = paths.out_dir.parent
    with open_page(paths.html, base) as driver:
        yield driver, base


@pytest.mark.browser
def test_compare_page_loads_offline_without_errors(page):
    from helpers.browser import network_urls as _network_urls

    driver, _ = page
    assert driver.execute_script("return document.readyState") == "complete"
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    urls = _network_urls(driver)
    assert any(u.startswith("file:") for u in urls)
    assert [u for u in urls if not u.startswith(("file:", "data:"))] == []


@pytest.mark.browser
def test_compare_page_images_render(page):
    driver, base = page
    sizes = driver.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight]);"
    )
    assert len(sizes) == 5
    assert all(done and w > 0 and h > 0 for done, w, h in sizes), sizes
    shot = base / "compare.png"
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


@pytest.mark.browser
def test_compare_page_hostile_name_is_text(page):
    driver, _ = page
    names = [e.text for e in driver.find_elements("css selector", "#members-table td.member-name")]
    assert EVIL in names
    assert driver.execute_script("return document.scripts.length") == 0


def test_two_seeds_of_one_model_are_told_apart(tmp_path):
    runs = []
    for seed in (0, 1):
        run = planted_run(tmp_path / f"seed{seed}", "pythia-70m", 1, 3, seed=seed)
        fit_run(run, FitConfig(n_boot=N_BOOT))
        runs.append(run)
    paths = api.compare(runs, tmp_path / "cmp", fit=FitConfig(n_boot=N_BOOT), curve=CurveConfig(scan=False))
    table = pd.read_csv(paths.members_csv)
    assert list(table["member"]) == ["pythia-70m (seed0)", "pythia-70m (seed1)"]
    assert (table["n_params_from"] == "pythia table").all() and (table["n_params"] == 70_426_624).all()
    assert json.loads(paths.members_json.read_text())["x_axis"] == "tau·lr_max"  # Pythia lr_max
