"""A headless Chromium behind selenium, for the tests that open a report page: skips (with
the extra's reason) when the browser, its driver or selenium is missing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .extras import missing

CHROME_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,2200",
)


def _browser_paths() -> tuple[str, str]:
    browser = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip(missing(
            "chromium", "headless browser test needs Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver); not found on PATH"
        ))
    return browser, driver


@contextmanager
def open_page(html: Path, base: Path) -> Iterator:
    """A headless Chromium driver showing ``html`` (file://), with its console and network logs
    emptied of the start page's entries; quits on exit. Skips without selenium or the browser."""
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="browser test needs selenium (pip install selenium)"
    )
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={base / 'profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        driver.get("about:blank")  # leave the start page, then drop what it logged
        driver.get_log("performance")
        driver.get_log("browser")
        driver.get(html.resolve().as_uri())
        yield driver
    finally:
        driver.quit()


def network_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            params = message["params"]
            urls.append(params.get("request", {}).get("url") or params.get("url", ""))
    return urls
