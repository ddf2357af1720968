"""Tests of peakprobe.reports on runs fitted by the real ``fit_run``.

Each run directory is raw: ``synthetic.make_run`` (tests/helpers/synthetic.py) writes what a sweep writes,
with planted laws (logit growth, gains G = share R_end (t / t_end)^-alpha, the loss law, a loss
spike, a duplicated checkpoint), and ``peakprobe.fits.fit_run`` fits it. The report must copy what
the fit wrote (checked against fits.parquet / fits.json read directly with pyarrow and json),
show the raw values of the last checkpoint (read from its parquet), draw curves that are the
planted closed forms, judge every exponent with the rule of ``fits.third.judge_third``, and
escape every user string (checked with Python's own HTML parser).
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
from helpers.synthetic import make_run

from peakprobe import results, vocab
from peakprobe.config import FitConfig
from peakprobe.fits import fit_run
from peakprobe.fits.third import judge_third
from peakprobe.reports import (
    FIGURE_NAMES,
    ReportError,
    heads_table,
    load_run,
    render_report,
    science,
)
from peakprobe.reports.tables import curve_sites, growth_curve, loss_curve, site_matrix
from peakprobe.results import write_checkpoint
from peakprobe.vocab import ATTN_ALL, BAND, BOTTLENECK_NONE, THIRD

EVIL_MODEL = "<script>alert(1)</script>"
EVIL_SOURCE = '<img src=x onerror="alert(2)">'
EVIL_DIR = "<img src=x onerror=alert(3)>"
L, H, C = 3, 4, 30  # 30 log-spread Pythia steps include step4, step64 and step35000
N_BOOT = 200
DUPLICATE, KEPT, SPIKE = "step4", "step64", 35000
REPO = Path(__file__).resolve().parents[2]


def _fitted(run_dir: Path, **kw):
    """A raw synthetic run fitted by the real fit_run; returns what was planted."""
    planted = make_run(run_dir, **kw)
    fit_run(run_dir, FitConfig(n_boot=N_BOOT))
    return planted


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fitted run (hostile names, a duplicate, a spike), rendered twice into two folders."""
    base = tmp_path_factory.mktemp("reports")
    run_dir = base / EVIL_DIR
    planted = _fitted(
        run_dir,
        n_layers=L,
        n_heads=H,
        n_checkpoints=C,
        seed=3,
        model=EVIL_MODEL,
        source=EVIL_SOURCE,
        duplicates={DUPLICATE: KEPT},
        spikes={SPIKE: 1.2},
    )
    paths = render_report(run_dir, command="peakprobe report 'x' <b>")
    again = base / "again"  # a second render in a fresh interpreter: no shared state
    code = (
        "import sys; from peakprobe.reports import render_report; "
        "render_report(sys.argv[1], out_dir=sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(run_dir), str(again)], check=True, cwd=REPO)
    return run_dir, planted, paths, again


def _fits(run_dir: Path) -> tuple[pd.DataFrame, dict]:
    return (
        pq.read_table(run_dir / "fits.parquet").to_pandas(),
        json.loads((run_dir / "fits.json").read_text()),
    )


def _last_checkpoint(run_dir: Path) -> pd.DataFrame:
    frames = [pq.read_table(f).to_pandas() for f in (run_dir / "checkpoints").glob("*.parquet")]
    last_step = max(int(f["step"].iloc[0]) for f in frames)
    return next(f for f in frames if int(f["step"].iloc[0]) == last_step)


def _strict_json(path: Path) -> dict:
    def no_nan(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    return json.loads(path.read_text(), parse_constant=no_nan)


def test_every_file_is_written(run):
    _, _, paths, _ = run
    for path in paths.all():
        assert path.exists() and path.stat().st_size > 0, path
    dense = set(FIGURE_NAMES) - {"router_curves"}  # every section measured; no MoE routers here
    assert {p.stem for p in paths.figures_png} == dense
    assert {p.stem for p in paths.figures_svg} == dense
    for png in paths.figures_png:
        img = mpimg.imread(png)  # (h, w, 4)
        assert img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.01
    for svg in paths.figures_svg:
        root = ElementTree.parse(svg).getroot()
        assert root.tag.endswith("svg") and float(root.get("width").rstrip("pt")) > 0


def test_heads_table_copies_the_fits(run):
    run_dir, planted, paths, _ = run
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    fits, _ = _fits(run_dir)
    assert len(heads) == L * H + 1  # one row per softmax site; attn_layer / attn_all are not heads
    growth = fits[(fits["fit"] == "growth") & (fits["metric"] == "logit_std")]
    gain = fits[fits["fit"] == "gain"]
    for r in heads.itertuples():
        key = (growth["site_kind"] == r.site_kind) & (growth["layer"] == r.layer) & (growth["head"] == r.head)
        f = growth[key].iloc[0]
        assert (r.alpha, r.alpha_lo, r.alpha_hi, r.r2) == (f["alpha"], f["alpha_lo"], f["alpha_hi"], f["r2"])
        assert (r.site_class, r.verdict, r.alpha_late) == (f["site_class"], f["verdict"], f["alpha_late"])
        g = gain[(gain["site_kind"] == r.site_kind) & (gain["layer"] == r.layer) & (gain["head"] == r.head)].iloc[0]
        assert (r.gain_alpha, r.gain_verdict, r.share, r.share_lo) == (g["alpha"], g["verdict"], g["share"], g["share_lo"])
    conc = [k for k, v in planted.kinds.items() if v == "concentrating"]
    attn = heads.set_index(["layer", "head"])
    assert all(abs(attn.loc[k, "alpha"] - THIRD) < 0.03 for k in conc)  # the planted 1/3
    csv = pd.read_csv(paths.heads_csv, keep_default_na=False, na_values=[""])
    assert list(csv.columns) == list(heads.columns)
    np.testing.assert_array_equal(csv["alpha"].to_numpy(), heads["alpha"].to_numpy())
    np.testing.assert_array_equal(csv["share"].to_numpy(), heads["share"].to_numpy())


def test_final_columns_are_the_last_checkpoint(run):
    run_dir, _, paths, _ = run
    heads = pq.read_table(paths.heads_parquet).to_pandas().set_index(["site_kind", "layer", "head"])
    last = _last_checkpoint(run_dir)
    last = last[last["site_kind"].isin(["attn", "lm_head"])]
    checked = set()
    for row in last.itertuples():
        column = "sensitivity" if row.metric == "sensitivity" else f"final_{row.metric}"
        if column in heads.columns:
            assert heads.loc[(row.site_kind, row.layer, row.head), column] == row.value, column
            checked.add(row.metric)
    assert {"logit_std", "peaked", "peaked_entropy", "beta_eff", "peaked_xsink", "gain", "loss",
            "first_key_prob", "sensitivity"} <= checked
    assert math.isnan(heads.loc[("lm_head", -1, -1), "final_first_key_prob"])  # attention only


def test_heatmap_matrix_is_the_fitted_alpha_grid(run):
    run_dir, _, _, _ = run
    fits, _ = _fits(run_dir)
    g = fits[(fits["fit"] == "growth") & (fits["metric"] == "logit_std") & (fits["site_kind"] == "attn")]
    expected = np.full((L, H), np.nan)
    expected[g["layer"], g["head"]] = g["alpha"]
    np.testing.assert_array_equal(site_matrix(heads_table(load_run(run_dir)), "alpha"), expected)


def test_growth_curve_is_the_fitted_law(run):
    run_dir, planted, _, _ = run
    data = load_run(run_dir)
    layer, head = next(k for k, v in sorted(planted.kinds.items()) if v == "concentrating")
    curve = growth_curve(data, "attn", layer, head)
    fits, _ = _fits(run_dir)
    row = fits[(fits["fit"] == "growth") & (fits["metric"] == "logit_std") & (fits["layer"] == layer) & (fits["head"] == head)].iloc[0]
    # tau = step here; the duplicated checkpoint is left out, as the fits left it out
    positive = np.array([s for s in planted.steps if s > 0 and f"step{s}" != DUPLICATE], dtype=float)
    np.testing.assert_array_equal(curve.t, positive)
    np.testing.assert_allclose(curve.fit_value, row["c"] * curve.fit_t ** row["alpha"], rtol=1e-12)
    assert curve.fit_t[0] == row["t_min"] and curve.fit_t[-1] == pytest.approx(row["t_max"])
    slopes = np.diff(np.log(curve.ref_value)) / np.diff(np.log(curve.fit_t))
    np.testing.assert_allclose(slopes, THIRD, rtol=1e-9)


def test_loss_curve_is_the_fitted_law(run):
    run_dir, planted, _, _ = run
    curve = loss_curve(load_run(run_dir))
    fits, _ = _fits(run_dir)
    row = fits[fits["fit"] == "loss"].iloc[0]
    expected = row["L0"] + row["c"] * curve.fit_t ** (-row["alpha"])
    np.testing.assert_allclose(curve.fit_value, expected, rtol=1e-12)
    slopes = np.diff(np.log(curve.ref_value - row["L0"])) / np.diff(np.log(curve.fit_t))
    np.testing.assert_allclose(slopes, -THIRD, rtol=1e-9)
    law = planted.loss_L0 + planted.loss_c * curve.t ** (-planted.loss_alpha)
    off_spike = curve.t != SPIKE
    np.testing.assert_allclose(curve.value[off_spike], law[off_spike], rtol=0.05)


def test_gain_curve_is_the_planted_and_fitted_law(run):
    run_dir, planted, _, _ = run
    curve = science.gain_curve(load_run(run_dir), ATTN_ALL, -1, -1)
    t_end = float(max(planted.steps))
    r_end = planted.loss_c * t_end ** (-planted.loss_alpha)
    share, alpha = planted.gain_shares[(ATTN_ALL, -1, -1)], planted.gain_alphas[(ATTN_ALL, -1, -1)]
    np.testing.assert_allclose(curve.value, share * r_end * (curve.t / t_end) ** -alpha, rtol=0.05)
    fits, _ = _fits(run_dir)
    row = fits[(fits["fit"] == "gain") & (fits["site_kind"] == ATTN_ALL)].iloc[0]
    np.testing.assert_allclose(curve.fit_value, row["c"] * curve.fit_t ** (-row["alpha"]), rtol=1e-12)
    slopes = np.diff(np.log(curve.ref_value)) / np.diff(np.log(curve.fit_t))
    np.testing.assert_allclose(slopes, -THIRD, rtol=1e-9)


def test_curve_sites_start_with_the_fitted_top_sites(run):
    run_dir, _, _, _ = run
    data = load_run(run_dir)
    sites, _ = curve_sites(data, heads_table(data), k=6)
    top = [("attn", s["layer"], s["head"]) for s in data.verdicts["bottleneck"]["top_sites"] if s["site_kind"] == "attn"]
    assert sites == top[: len(sites)] and len(sites) == 6


def test_summary_copies_the_verdicts(run):
    run_dir, _, paths, _ = run
    s = _strict_json(paths.summary_json)
    fits, verdicts = _fits(run_dir)
    assert s["format"] == 2 and s["model"] == EVIL_MODEL and s["band"] == verdicts["band"]
    assert s["loss"]["verdict"] == verdicts["loss"]["verdict"]
    assert s["loss"]["alpha"] == verdicts["loss"]["alpha"]
    b, given = s["bottleneck"], verdicts["bottleneck"]
    assert (b["verdict"], b["reason"]) == (given["verdict"], given["reason"])
    assert {k["kind"]: k["share"] for k in b["kinds"]} == {k: v["share"] for k, v in given["kinds"].items()}
    attn_all = fits[(fits["fit"] == "gain") & (fits["site_kind"] == ATTN_ALL)].iloc[0]
    g = next(g for g in s["gains"]["sites"] if g["site_kind"] == ATTN_ALL)
    assert (g["alpha"], g["share"], g["verdict"]) == (attn_all["alpha"], attn_all["share"], attn_all["verdict"])
    assert [r["alpha"] for r in s["window_scan"]["rows"]] == [r["alpha"] for r in verdicts["loss_scan"]["rows"]]
    assert [r["verdict"] for r in s["window_scan"]["rows"]] == [r["verdict"] for r in verdicts["loss_scan"]["rows"]]
    assert s["peakedness"]["any_peaked"] is True


def test_every_exponent_is_judged_with_band_and_window(run):
    _, _, paths, _ = run
    s = _strict_json(paths.summary_json)
    band = tuple(s["band"])
    quantities = {e["quantity"] for e in s["exponents"]}
    assert {"loss L − L0 decay", "gain G decay", "logit_std growth"} <= quantities
    for e in s["exponents"]:  # fit's verdict, which must be the rule applied to the interval
        assert e["verdict"] == judge_third(e["alpha_lo"], e["alpha_hi"], band), e
        assert e["t_min"] > 0 and e["t_max"] > e["t_min"], e
    html_text = paths.html.read_text()
    table = html_text.split('id="exponents-table"', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == len(s["exponents"]) + 1
    assert table.count(f"[{band[0]:g}, {band[1]:g}]") == len(s["exponents"])


def test_fit_verdict_wins_and_the_rule_fills_in():
    assert science.judged("inconclusive", 0.30, 0.36, BAND) == "inconclusive"  # fit's word
    assert science.judged(None, 0.30, 0.36, BAND) == "consistent"
    assert science.judged(None, 0.10, 0.60, BAND) == "inconclusive"  # wide: never consistent
    assert science.judged(None, 0.40, 0.50, BAND) == "inconsistent"
    assert science.judged(None, None, None, BAND) == "inconclusive"


def test_duplicates_and_spikes_are_listed(run):
    run_dir, _, paths, _ = run
    s = _strict_json(paths.summary_json)
    _, verdicts = _fits(run_dir)
    dups = s["checkpoints"]["duplicates"]
    assert [(d["revision"], d["same_as"], d["excluded"]) for d in dups] == [(DUPLICATE, [KEPT], True)]
    assert [d["revision"] for d in s["checkpoints"]["spikes"]] == [sp["revision"] for sp in verdicts["spikes"]]
    assert f"step{SPIKE}" in [d["revision"] for d in s["checkpoints"]["spikes"]]
    html_text = paths.html.read_text()
    assert 'id="duplicates"' in html_text and 'id="spikes"' in html_text
    md = paths.summary_md.read_text()
    assert f"`{DUPLICATE}` has the same weights as `{KEPT}` — excluded from the fits" in md


def test_data_files_are_byte_identical_and_html_differs_only_in_provenance(run):
    _, _, first, again = run
    written = [p for p in first.all() if p.name != "report.html"]
    assert len(written) == 4 + 2 * (len(FIGURE_NAMES) - 1)  # no router figure: a dense model
    for path in written:
        twin = again / path.relative_to(first.out_dir)
        assert path.read_bytes() == twin.read_bytes(), path.name
    for svg in first.figures_svg:
        assert b"<dc:date>" not in svg.read_bytes()
    a = first.html.read_text().splitlines()
    b = (again / "report.html").read_text().splitlines()
    assert len(a) == len(b)
    differ = [x for x, y in zip(a, b, strict=True) if x != y]
    assert differ and all(x.startswith(("<dt>command</dt>", "<dt>generated</dt>")) for x in differ)


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
    _, _, paths, _ = run
    page = _Collector()
    page.feed(paths.html.read_text())
    sources = [a.get("src") for t, a in page.tags if t in ("img", "script", "iframe", "embed")]
    assert sources and all(s is None or s.startswith("data:") for s in sources)
    assert not [t for t, a in page.tags if t == "link" or (t == "a" and "href" in a)]
    assert len([a for t, a in page.tags if t == "img"]) == len(FIGURE_NAMES) - 1  # no router figure
    html_text = paths.html.read_text()
    assert "url(" not in html_text and "@import" not in html_text
    for section in ("verdict", "exponents", "gains", "window-scan", "peakedness", "integrity", "heads"):
        assert f'<section id="{section}">' in html_text
    for missing in ("gains-missing", "window-scan-missing", "sensitivity-missing", "no-peaked"):
        assert f'id="{missing}"' not in html_text
    body = html_text.split('id="heads-table"', 1)[1].split("</table>", 1)[0]
    assert body.count("<tr>") == L * H + 1 + 1  # header + one row per site
    for header in ("layer", "head", "class", "α [90% CI]", "vs 1/3", "gain share", "peaked", "peaked (entropy)", "β_eff"):
        assert f">{header}</th>" in body


def test_run_without_gains_or_sensitivity_says_not_measured(tmp_path):
    run_dir = tmp_path / "run"
    _fitted(
        run_dir, n_layers=2, n_heads=3, n_checkpoints=24, seed=1, gains=None, sensitivity=False,
        peaked_entropy=False, xsink=False,
    )
    stale = run_dir / "report" / "figures" / "gain_curves.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from an earlier render")
    paths = render_report(run_dir)
    s = _strict_json(paths.summary_json)
    assert s["gains"] == {"measured": False, "sites": []}
    assert s["sensitivity"]["measured"] is False and s["sensitivity"]["top"] == []
    assert not [e for e in s["exponents"] if e["quantity"] == "gain G decay"]
    assert not stale.exists() and {"gain_curves", "sensitivity"}.isdisjoint(s["figures"])
    html_text = paths.html.read_text()
    assert 'id="gains-missing"' in html_text and 'id="sensitivity-missing"' in html_text
    heads_header = html_text.split('id="heads-table"', 1)[1].split("</thead>", 1)[0]
    assert ">sensitivity</th>" not in heads_header and ">gain share</th>" not in heads_header
    assert "d loss / d log β</th>" not in html_text.split('id="top-sites-table"', 1)[1].split("</table>")[0]
    assert "Not measured in this run (the sweep ran without gains)" in paths.summary_md.read_text()
    criteria = {c["metric"]: c["measured"] for c in s["peakedness"]["criteria"]}
    assert criteria == {"peaked": True, "peaked_entropy": False}  # no _xsink rows when unmeasured
    table = html_text.split('id="peakedness-table"', 1)[1].split("</table>", 1)[0]
    assert table.count("not measured") == 1 and "peaked_entropy_heatmap" not in s["figures"]


def test_no_peaked_softmax_is_said_prominently(tmp_path):
    run_dir = tmp_path / "run"
    kinds = {(la, h): "diffuse" for la in range(2) for h in range(2)}
    planted = _fitted(
        run_dir, n_layers=2, n_heads=2, n_checkpoints=24, seed=2, kinds=kinds, lm_head_kind="diffuse"
    )
    assert planted.expected_bottleneck == BOTTLENECK_NONE
    paths = render_report(run_dir)
    s = _strict_json(paths.summary_json)
    assert s["bottleneck"]["verdict"] == BOTTLENECK_NONE
    assert s["peakedness"]["any_peaked"] is False
    assert all(c["n_attn_peaked"] == 0 for c in s["peakedness"]["criteria"])
    html_text = paths.html.read_text()
    banner = html_text.index('id="no-peaked"')
    assert banner < html_text.index('<section id="verdict">')  # above everything else
    assert "does not apply" in html_text[banner : banner + 600]
    assert paths.summary_md.read_text().splitlines()[2].startswith("> **No softmax is peaked.**")


def test_nothing_peaked_by_logit_std_alone_is_not_called_absent(tmp_path):
    """Without the entropy criterion, nothing peaked by logit std is fit's ``undetermined``, and
    the page says the run cannot rule the mechanism out."""
    run_dir = tmp_path / "run"
    kinds = {(0, h): "diffuse" for h in range(2)}
    _fitted(run_dir, n_layers=1, n_heads=2, n_checkpoints=24, seed=2, kinds=kinds,
            lm_head_kind="diffuse", peaked_entropy=False)
    paths = render_report(run_dir)
    s = _strict_json(paths.summary_json)
    assert s["bottleneck"]["verdict"] != BOTTLENECK_NONE and s["peakedness"]["any_peaked"] is False
    html_text = paths.html.read_text()
    banner = html_text[html_text.index('id="no-peaked"'):].split("</p>", 1)[0]
    assert "cannot show that the 1/3 mechanism is absent" in banner and "does not apply" not in banner


def test_encoder_without_lm_head_and_an_unfitted_head(tmp_path):
    """No LM head (an encoder), and one head that fit skipped: the report still renders."""
    run_dir = tmp_path / "run"
    _fitted(run_dir, n_layers=2, n_heads=3, n_checkpoints=24, seed=4, gains=None)
    for path in (run_dir / "checkpoints").glob("*.parquet"):
        df = pq.read_table(path).to_pandas()
        write_checkpoint(run_dir, df["revision"].iloc[0], df[df["site_kind"] == "attn"])
    fits = pq.read_table(run_dir / "fits.parquet").to_pandas()
    fits = fits[(fits["site_kind"] == "attn") & ~((fits["layer"] == 1) & (fits["head"] == 2))]
    fits.to_parquet(run_dir / "fits.parquet", index=False)
    verdicts = json.loads((run_dir / "fits.json").read_text())
    verdicts["loss"] = None
    verdicts["loss_scan"] = None
    (run_dir / "fits.json").write_text(json.dumps(verdicts))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = render_report(run_dir)
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    assert len(heads) == 6 and set(heads["site_kind"]) == {"attn"}
    missing = heads[(heads["layer"] == 1) & (heads["head"] == 2)].iloc[0]
    assert math.isnan(missing["alpha"]) and missing["n_points"] == -1 and missing["site_class"] == ""
    assert not math.isnan(missing["final_logit_std"])  # measured, just not fitted
    s = _strict_json(paths.summary_json)
    assert s["loss"] is None and s["lm_head"] is None and s["attention"]["n_fitted"] == 5
    assert s["window_scan"]["measured"] is False
    html_text = paths.html.read_text()
    assert "loss_curve" not in s["figures"] and 'id="loss-missing"' in html_text
    assert 'id="window-scan-missing"' in html_text


def test_missing_or_malformed_fits_are_one_line_errors(tmp_path):
    run_dir = tmp_path / "run"
    _fitted(run_dir, n_layers=1, n_heads=2, n_checkpoints=20, gains=None)
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


def test_reports_never_import_torch_and_ship_their_templates():
    code = (
        "import sys, importlib.resources as r, peakprobe.reports; "
        "t = r.files('peakprobe.reports') / 'templates'; "
        "print('torch' in sys.modules); print(*sorted(p.name for p in t.iterdir()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    torch_loaded, names = out.stdout.splitlines()
    assert torch_loaded == "False"
    assert {"report.css", "report.html.j2", "sort.js"} <= set(names.split())
    setup = (REPO / "setup.cfg").read_text()
    assert "peakprobe.reports = templates/*" in setup and "jinja2>=3.1" in setup


@pytest.mark.slow
def test_pythia_12b_shape_report_stays_small(tmp_path):
    """The acceptance size bound (timing is benchmarks/report.py's job, not a test's)."""
    _fitted(tmp_path / "run", n_layers=36, n_heads=40, n_checkpoints=30, seed=2)
    paths = render_report(tmp_path / "run")
    assert paths.html.stat().st_size < 10 * 1024 * 1024
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    assert len(heads) == 36 * 40 + 1
    assert paths.html.read_text().split('id="heads-table"', 1)[1].count("<tr>") == 36 * 40 + 2


def test_the_max_logit_has_its_column_figure_and_growth_fit(run):
    """The planted largest logit (3 c0 beta, noise-free) is the heads table's final value as the
    results hold it, its growth exponent is logit_std's (planted from the same beta, with noise),
    and it has its own figure."""
    run_dir, planted, paths, _ = run
    heads = pq.read_table(paths.heads_parquet).to_pandas()
    res = results.read_results(run_dir)
    last = res[(res["step"] == res["step"].max()) & (res["metric"] == vocab.LOGIT_MAX)]
    want = last.set_index(["site_kind", "layer", "head"])["value"]
    got = heads.set_index(["site_kind", "layer", "head"])["final_logit_max"]
    pd.testing.assert_series_equal(got.sort_index(), want.reindex(got.index).sort_index(), check_names=False)
    fits, _ = _fits(run_dir)
    growth = fits[fits["fit"] == "growth"].set_index(["site_kind", "layer", "head", "metric"])["alpha"]
    mine = growth.xs(vocab.LOGIT_MAX, level="metric").dropna()
    assert len(mine) == L * H + 1
    for site, alpha in mine.items():
        assert alpha == pytest.approx(growth.loc[(*site, vocab.LOGIT_STD)], abs=0.05), site
    assert "logit_max_curves" in {p.stem for p in paths.figures_png}
    assert "Largest logit per layer" in paths.html.read_text()


def test_json_files_hold_nan_and_infinities_as_null(tmp_path):
    """write_json (every JSON file of a run) and failures.jsonl: NaN, inf and numpy scalars
    read back as null and Python numbers; nothing is written as a bare NaN."""
    obj = {"a": math.nan, "b": [np.float64("inf"), np.float32(1.5), np.int64(3)],
           "c": (np.bool_(True), -math.inf), 4: {"d": None}}
    results.write_json(tmp_path / "x.json", obj)
    text = (tmp_path / "x.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None, 1.5, 3], "c": [True, None], "4": {"d": None}}
    results.append_failure(tmp_path, {"revision": "step1", "loss": math.nan})
    assert results.read_failures(tmp_path) == [{"revision": "step1", "loss": None}]


def test_roles_line_lists_each_roles_heads_by_score():
    """The terminal line of the head roles: per role (the role of the best head first) its count
    and heads (best first, at most ``most`` named), none when no head holds one, nothing when the run has no role scores."""
    from peakprobe.reports.markdown import roles_text

    def head(layer, role, score, step):
        return {"label": f"attn L{layer} H0", "layer": layer, "head": 0, "role": role,
                "score": score, "since_step": step}

    roles = {"measured": True, "threshold": 0.4,
             "heads": [head(0, "previous-token", 0.5, 10), head(1, "induction", 0.9, 40),
                       head(2, "previous-token", 0.7, 20), head(3, "previous-token", 0.6, 30)]}
    line = roles_text(roles, most=2)
    assert line.startswith("head roles (diagnostic batch, score >= 0.4 at the last checkpoint): ")
    assert line.endswith(": induction 1 (attn L1 H0 0.90, since step 40); previous-token 3 "
                         "(attn L2 H0 0.70, since step 20, attn L3 H0 0.60, since step 30, 1 more)")
    assert roles_text({**roles, "heads": []}).endswith(": none")
    assert roles_text({"measured": False, "heads": []}) is None and roles_text({}) is None
