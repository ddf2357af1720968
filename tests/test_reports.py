"""Tests of peakprobe.reports against independent references.

The run directories come from ``peakprobe.reports.synthetic``: their logit_std follows c·t^alpha and
their loss L0 + c·t^-alpha with parameters known in advance, and their fits.parquet holds exactly
those parameters. Final metrics are checked against the last checkpoint's parquet read directly;
curves against the closed-form laws; the HTML with Python's own HTML parser.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import warnings
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from peakprobe.reports import FIGURE_NAMES, ReportError, heads_table, load_run, render_report
from peakprobe.reports.summary import loss_relation
from peakprobe.reports.synthetic import write_synthetic_run
from peakprobe.reports.tables import curve_sites, growth_curve, loss_curve, site_matrix
from peakprobe.results import write_checkpoint

EVIL_MODEL = "<script>alert(1)</script>"
EVIL_SOURCE = '<img src=x onerror="alert(2)">'
EVIL_DIR = "<img src=x onerror=alert(3)>"
L, H, C = 3, 4, 8
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fitted synthetic run (hostile names), rendered twice into two folders."""
    base = tmp_path_factory.mktemp("reports")
    run_dir = base / EVIL_DIR
    truth = write_synthetic_run(
        run_dir,
        n_layers=L,
        n_heads=H,
        n_checkpoints=C,
        model=EVIL_MODEL,
        source=EVIL_SOURCE,
        seed=3,
    )
    paths = render_report(run_dir, command="peakprobe report 'x' <b>")
    again = (
        base / "again"
    )  # a second render in a fresh interpreter: no shared state, new hash seeds
    code = "import sys; from peakprobe.reports import render_report; render_report(sys.argv[1], out_dir=sys.argv[2])"
    subprocess.run([sys.executable, "-c", code, str(run_dir), str(again)], check=True, cwd=REPO)
    return run_dir, truth, paths, again


def _last_checkpoint(run_dir: Path) -> pd.DataFrame:
    frames = [pq.read_table(f).to_pandas() for f in (run_dir / "checkpoints").glob("*.parquet")]
    last_step = max(int(f["step"].iloc[0]) for f in frames)
    return next(f for f in frames if int(f["step"].iloc[0]) == last_step)


def test_every_file_is_written(run):
    _, _, paths, _ = run
    for path in paths.all():
        assert path.exists() and path.stat().st_size > 0, path
    assert {p.stem for p in paths.figures_png} == set(FIGURE_NAMES)
    assert {p.stem for p in paths.figures_svg} == set(FIGURE_NAMES)
    for png in paths.figures_png:
        img = mpimg.imread(png)  # (h, w, 4)
        assert img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.01
    for svg in paths.figures_svg:
        root = ElementTree.parse(svg).getroot()
        assert root.tag.endswith("svg") and float(root.get("width").rstrip("pt")) > 0


def test_heads_table_copies_the_fitted_exponents(run):
    run_dir, truth, paths, _ = run
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    fits = pq.read_table(run_dir / "fits.parquet").to_pandas()
    assert len(heads) == L * H + 1  # one row per site, LM head included
    attn = heads[heads["site_kind"] == "attn"]
    for r in attn.itertuples():
        f = fits[
            (fits["fit"] == "growth") & (fits["layer"] == r.layer) & (fits["head"] == r.head)
        ].iloc[0]
        assert r.alpha == f["alpha"] == truth.alpha[r.layer, r.head]
        assert (r.alpha_lo, r.alpha_hi, r.r2) == (f["alpha_lo"], f["alpha_hi"], f["r2"])
        assert r.site_class == truth.site_class[r.layer, r.head]
    lm = heads[heads["site_kind"] == "lm_head"].iloc[0]
    assert lm["alpha"] == truth.lm_alpha and (lm["layer"], lm["head"]) == (-1, -1)
    csv = pd.read_csv(paths.heads_csv, keep_default_na=False, na_values=[""])
    assert list(csv.columns) == list(heads.columns)
    np.testing.assert_array_equal(csv["alpha"].to_numpy(), heads["alpha"].to_numpy())
    np.testing.assert_array_equal(
        csv["final_logit_std"].to_numpy(), heads["final_logit_std"].to_numpy()
    )


def test_final_columns_are_the_last_checkpoint(run):
    run_dir, _, paths, _ = run
    heads = pq.read_table(paths.heads_parquet).to_pandas().set_index(["site_kind", "layer", "head"])
    last = _last_checkpoint(run_dir)
    checked = 0
    for row in last.itertuples():
        column = "sensitivity" if row.metric == "sensitivity" else f"final_{row.metric}"
        assert heads.loc[(row.site_kind, row.layer, row.head), column] == row.value
        checked += 1
    assert checked == len(last)
    assert math.isnan(
        heads.loc[("lm_head", -1, -1), "final_first_key_prob"]
    )  # attention-only metric


def test_heatmap_matrix_is_the_fitted_alpha_grid(run):
    run_dir, truth, _, _ = run
    data = load_run(run_dir)
    heads = heads_table(data)
    np.testing.assert_array_equal(site_matrix(heads, "alpha"), truth.alpha)  # (L, H)
    assert site_matrix(heads, "final_peaked").shape == (L, H)


def test_growth_curve_is_the_closed_form_law(run):
    run_dir, truth, _, _ = run
    data = load_run(run_dir)
    layer, head = map(int, np.argwhere(truth.site_class == "concentrating")[0])
    curve = growth_curve(data, "attn", layer, head)
    positive_tau = np.array([t for t in truth.tau if t > 0])
    np.testing.assert_array_equal(
        curve.t, positive_tau
    )  # the fits' time axis is tau, step 0 dropped
    a, c = truth.alpha[layer, head], truth.c[layer, head]
    np.testing.assert_allclose(curve.value, c * positive_tau**a, rtol=0.05)  # 1% noise
    np.testing.assert_allclose(curve.fit_value, c * curve.fit_t**a, rtol=1e-12)
    assert curve.fit_t[0] == positive_tau[0] and curve.fit_t[-1] == pytest.approx(positive_tau[-1])
    slopes = np.diff(np.log(curve.ref_value)) / np.diff(np.log(curve.fit_t))
    np.testing.assert_allclose(slopes, 1 / 3, rtol=1e-9)
    t_mid = math.sqrt(positive_tau[0] * positive_tau[-1])
    ref_mid = np.interp(math.log(t_mid), np.log(curve.fit_t), np.log(curve.ref_value))
    assert ref_mid == pytest.approx(math.log(c * t_mid**a), abs=1e-9)


def test_loss_curve_is_the_closed_form_law(run):
    run_dir, truth, _, _ = run
    curve = loss_curve(load_run(run_dir))
    expected = truth.loss_L0 + truth.loss_c * curve.fit_t ** (-truth.loss_alpha)
    np.testing.assert_allclose(curve.fit_value, expected, rtol=1e-12)
    slopes = np.diff(np.log(curve.ref_value - truth.loss_L0)) / np.diff(np.log(curve.fit_t))
    np.testing.assert_allclose(slopes, -1 / 3, rtol=1e-9)
    np.testing.assert_allclose(
        curve.value, truth.loss_L0 + truth.loss_c * curve.t ** (-truth.loss_alpha), rtol=0.05
    )


def test_curve_sites_start_with_the_fitted_top_sites(run):
    run_dir, truth, _, _ = run
    data = load_run(run_dir)
    sites, _ = curve_sites(data, heads_table(data), k=6)
    top = [("attn", s["layer"], s["head"]) for s in data.verdicts["bottleneck"]["top_sites"]]
    assert sites[: len(top)] == top[:6]
    assert all(truth.site_class[layer, head] == "concentrating" for _, layer, head in sites)
    assert len(sites) == min(6, int((truth.site_class == "concentrating").sum()))


def test_summary_json_is_strict_and_agrees_with_the_inputs(run):
    run_dir, truth, paths, _ = run

    def no_nan(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    summary = json.loads(paths.summary_json.read_text(), parse_constant=no_nan)
    assert summary["model"] == EVIL_MODEL
    assert (
        summary["loss"]["alpha"] == truth.loss_alpha and summary["loss"]["relation"] == "consistent"
    )
    assert summary["bottleneck"]["verdict"] == "attention"
    counts = {
        k: int((truth.site_class == k).sum()) for k in ("concentrating", "saturated", "diffuse")
    }
    assert summary["attention"]["class_counts"] == counts
    assert (summary["attention"]["n_layers"], summary["attention"]["n_heads"]) == (L, H)
    assert summary["checkpoints"]["n"] == C and summary["checkpoints"]["last_step"] == max(
        truth.steps
    )
    sens = _last_checkpoint(run_dir)
    sens = sens[sens["metric"] == "sensitivity"].sort_values("value")
    expected = [(r.site_kind, r.layer, r.head, r.value) for r in sens.head(10).itertuples()]
    got = [
        (t["site_kind"], t["layer"], t["head"], t["sensitivity"])
        for t in summary["sensitivity"]["top"]
    ]
    assert got == expected
    md = paths.summary_md.read_text()
    assert f"`{EVIL_MODEL}`" in md and "0.34 [0.32, 0.36]" in md


@pytest.mark.parametrize(
    ("alpha", "lo", "hi", "in_ci", "expected"),
    [
        (0.5, 0.45, 0.55, None, "faster"),
        (0.2, 0.15, 0.25, None, "slower"),
        (0.33, 0.30, 0.36, None, "consistent"),
        (float("nan"), float("nan"), float("nan"), None, "undetermined"),
        (0.40, 0.30, 0.50, False, "faster"),  # fits.json's own test wins over the CI
        (0.30, 0.31, 0.35, True, "consistent"),
    ],
)
def test_loss_relation_against_one_third(alpha, lo, hi, in_ci, expected):
    assert loss_relation(alpha, lo, hi, in_ci) == expected


def test_data_files_are_byte_identical(run):
    _, _, first, again = run
    written = [p for p in first.all() if p.name != "report.html"]
    assert len(written) == 4 + 2 * len(FIGURE_NAMES)
    for path in written:
        twin = again / path.relative_to(first.out_dir)
        assert path.read_bytes() == twin.read_bytes(), path.name
    for svg in first.figures_svg:
        assert b"<dc:date>" not in svg.read_bytes()


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        (self.scripts if self._in_script else self.text).append(data)


def test_html_escapes_every_user_string(run):
    _, _, paths, _ = run
    page = _Collector()
    page.feed(paths.html.read_text())
    assert [t for t, _ in page.tags].count("script") == 1  # the sorting script only
    assert not any("alert" in s for s in page.scripts)
    assert not any(any(k.startswith("on") for k in attrs) for _, attrs in page.tags)
    text = "".join(page.text)
    assert EVIL_MODEL in text and EVIL_SOURCE in text and EVIL_DIR in text
    assert "peakprobe report 'x' <b>" in text  # the command, shown as text


def test_html_is_self_contained_and_complete(run):
    _, truth, paths, _ = run
    page = _Collector()
    page.feed(paths.html.read_text())
    sources = [
        attrs.get("src") for tag, attrs in page.tags if tag in ("img", "script", "iframe", "embed")
    ]
    assert sources and all(s is None or s.startswith("data:") for s in sources)
    assert not [t for t, a in page.tags if t == "link" or (t == "a" and "href" in a)]
    assert len([a for t, a in page.tags if t == "img"]) == len(FIGURE_NAMES)
    html_text = paths.html.read_text()
    assert "url(" not in html_text and "@import" not in html_text
    body = html_text.split('id="heads-table"', 1)[1].split("</table>", 1)[0]
    assert body.count("<tr>") == L * H + 1 + 1  # header + one row per site
    for header in (
        "layer",
        "head",
        "class",
        "α [90% CI]",
        "R²",
        "final entropy",
        "max_prob",
        "logit_std",
        "peaked",
        "first_key_prob",
    ):
        assert f">{header}</th>" in body
    assert (
        f"α = {truth.loss_alpha:.3g} [{truth.loss_alpha - 0.02:.3g}, {truth.loss_alpha + 0.02:.3g}]"
        in html_text
    )


def test_unmeasured_sensitivity_and_fast_loss_are_reported(tmp_path):
    run_dir = tmp_path / "run"
    write_synthetic_run(
        run_dir,
        n_layers=2,
        n_heads=2,
        n_checkpoints=5,
        sensitivity=False,
        loss_alpha=0.5,
        loss_ci=(0.45, 0.55),
        seed=1,
    )
    stale = run_dir / "report" / "figures" / "sensitivity.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from an earlier render")
    paths = render_report(run_dir)
    summary = json.loads(paths.summary_json.read_text())
    assert summary["sensitivity"] == {
        "measured": False,
        "order": summary["sensitivity"]["order"],
        "top": [],
    }
    assert summary["loss"]["relation"] == "faster"
    assert not stale.exists() and "sensitivity" not in {p.stem for p in paths.figures_png}
    html_text = paths.html.read_text()
    assert 'id="sensitivity-missing"' in html_text and "faster than 1/3" in html_text
    assert ">sensitivity</th>" not in html_text


def test_encoder_without_lm_head_and_an_unfitted_head(tmp_path):
    """No LM head (an encoder), and one head that fit skipped: the report still renders."""
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir, n_layers=2, n_heads=3, n_checkpoints=5, seed=4)
    for path in (run_dir / "checkpoints").glob("*.parquet"):
        df = pq.read_table(path).to_pandas()
        write_checkpoint(run_dir, df["revision"].iloc[0], df[df["site_kind"] == "attn"])
    fits = pq.read_table(run_dir / "fits.parquet").to_pandas()
    fits = fits[(fits["site_kind"] == "attn") & ~((fits["layer"] == 1) & (fits["head"] == 2))]
    fits.to_parquet(run_dir / "fits.parquet", index=False)
    verdicts = json.loads((run_dir / "fits.json").read_text())
    verdicts["loss"] = None
    (run_dir / "fits.json").write_text(json.dumps(verdicts))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = render_report(run_dir)
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    assert len(heads) == 6 and set(heads["site_kind"]) == {"attn"}
    missing = heads[(heads["layer"] == 1) & (heads["head"] == 2)].iloc[0]
    assert (
        math.isnan(missing["alpha"]) and missing["n_points"] == -1 and missing["site_class"] == ""
    )
    assert not math.isnan(missing["final_logit_std"])  # measured, just not fitted
    summary = json.loads(paths.summary_json.read_text())
    assert summary["loss"] is None and summary["lm_head"] is None
    assert summary["attention"]["n_fitted"] == 5
    assert "loss_curve" not in summary["figures"] and 'id="loss-missing"' in paths.html.read_text()


def test_missing_or_malformed_fits_are_one_line_errors(tmp_path):
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir, n_layers=1, n_heads=2, n_checkpoints=3)
    fits = pq.read_table(run_dir / "fits.parquet").to_pandas()
    fits.drop(columns=["site_class"]).to_parquet(run_dir / "fits.parquet")
    with pytest.raises(ReportError, match="site_class.*peakprobe fit") as err:
        render_report(run_dir)
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)
    (run_dir / "fits.parquet").unlink()
    with pytest.raises(ReportError, match="run `peakprobe fit"):
        render_report(run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(ValueError, match="no finished checkpoints"):
        render_report(run_dir)


def test_reports_never_import_torch():
    code = (
        "import sys, peakprobe.reports, peakprobe.reports.synthetic; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert out.stdout.strip() == "False"


def test_pythia_12b_shape_report_stays_small(tmp_path):
    """The acceptance size bound (timing is benchmarks/report.py's job, not a test's)."""
    write_synthetic_run(tmp_path / "run", n_layers=36, n_heads=40, n_checkpoints=30, seed=2)
    paths = render_report(tmp_path / "run")
    assert paths.html.stat().st_size < 10 * 1024 * 1024
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    assert len(heads) == 36 * 40 + 1
    assert paths.html.read_text().split('id="heads-table"', 1)[1].count("<tr>") == 36 * 40 + 2
