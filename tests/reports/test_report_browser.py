"""report.html in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``, via selenium).

The run is raw synthetic (tests/helpers/synthetic.py) fitted by the real ``fit_run``, so every section
has a figure. Checks: it loads from a file:// URL with no SEVERE console message and no request
other than file:/data:; every image decodes to a non-zero natural size (inline SVGs have a non-zero box);
hostile names stay text; clicking a header re-sorts the per-head table (numeric-aware, descending
then ascending, cells without a number last). Skips with a message when the browser, its driver
or selenium is missing. A screenshot is saved under pytest's tmp folder (never in the repo).
"""

from __future__ import annotations

import math

import pytest
from helpers.browser import _browser_paths, network_urls, open_page
from helpers.synthetic import make_run

from peakprobe.config import FitConfig
from peakprobe.fits import fit_run
from peakprobe.reports import FIGURE_NAMES, render_report

pytestmark = pytest.mark.browser

EVIL_MODEL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    pytest.importorskip("selenium.webdriver", reason="browser test needs selenium (pip install selenium)")
    _browser_paths()  # skip before the run is built when the browser is missing
    base = tmp_path_factory.mktemp("browser")
    make_run(
        base / "run", n_layers=3, n_heads=5, n_checkpoints=30, model=EVIL_MODEL, seed=5,
        duplicates={"step4": "step64"},
    )
    fit_run(base / "run", FitConfig(n_boot=100))
    paths = render_report(base / "run")
    with open_page(paths.html, base) as driver:
        yield driver, base


def _column(driver, header: str) -> list[float]:
    """Numbers in the per-head table's column ``header``, top to bottom (NaN for an em dash)."""
    values = driver.execute_script(
        """
        const table = document.getElementById('heads-table');
        const col = Array.from(table.tHead.rows[0].cells).findIndex(th => th.textContent === arguments[0]);
        return Array.from(table.tBodies[0].rows).map(r => {
            const c = r.cells[col]; return c.hasAttribute('data-v') ? c.getAttribute('data-v') : c.textContent; });
        """,
        header,
    )
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            out.append(math.nan)
    return out


def _click(driver, header: str) -> None:
    for th in driver.find_elements("css selector", "#heads-table thead th"):
        if th.text.strip().startswith(header) and th.get_attribute("textContent") == header:
            th.click()
            return
    raise AssertionError(f"no header {header!r}")


def test_loads_offline_without_errors(page):
    driver, _ = page
    assert driver.execute_script("return document.readyState") == "complete"
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    urls = network_urls(driver)
    assert any(u.startswith("file:") for u in urls)  # the log works: the page itself was seen
    assert [u for u in urls if not u.startswith(("file:", "data:"))] == []


def test_every_image_renders(page):
    driver, _ = page
    sizes = driver.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight]);"
    )
    # every section drawn for a dense run with gains: all figures but the MoE routers'
    assert len(sizes) == len([n for n in FIGURE_NAMES if n != "router_curves"])
    assert all(done and w > 0 and h > 0 for done, w, h in sizes), sizes
    boxes = driver.execute_script(
        "return Array.from(document.querySelectorAll('svg')).map(s => [s.getBBox().width, s.getBBox().height]);"
    )
    assert all(w > 0 and h > 0 for w, h in boxes), boxes


def test_hostile_model_name_is_text(page):
    driver, _ = page
    assert driver.find_element("id", "model-name").text == EVIL_MODEL
    assert driver.execute_script("return document.scripts.length") == 1


def test_header_click_sorts_numerically(page):
    driver, base = page
    before = _column(driver, "logit_std")
    finite = [v for v in before if not math.isnan(v)]
    assert finite != sorted(finite) and finite != sorted(finite, reverse=True)  # not already sorted
    _click(driver, "logit_std")
    desc = _column(driver, "logit_std")
    assert desc == sorted(before, reverse=True)  # all finite: plain numeric order
    _click(driver, "logit_std")
    assert _column(driver, "logit_std") == sorted(before)

    _click(driver, "first_key_prob")  # the LM head has none: it stays last both ways
    desc = _column(driver, "first_key_prob")
    assert math.isnan(desc[-1]) and desc[:-1] == sorted(desc[:-1], reverse=True)
    _click(driver, "first_key_prob")
    asc = _column(driver, "first_key_prob")
    assert math.isnan(asc[-1]) and asc[:-1] == sorted(asc[:-1])

    _click(driver, "α [90% CI]")  # sorted by the exponent, not by the text "0.3 [..]"
    alphas = _column(driver, "α [90% CI]")
    assert alphas == sorted(alphas, reverse=True) and len(alphas) == 3 * 5 + 1
    driver.execute_script("window.scrollTo(0, 0)")
    shot = base / "report.png"
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
