"""Shared fixtures and pytest hooks: --runslow, and PEAKPROBE_REQUIRE (a skip for a missing
extra that CI installed is a failure). The builders the tests import live in ``helpers``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_tiny_lm(tmp_path_factory) -> Path:
    """The demo's tiny LM (default TinyLMConfig), trained once per session for the slow tests
    (into $PEAKPROBE_TINY_LM_DIR when set, so a finished run there is reused)."""
    from peakprobe.toy.tiny_lm import train_tiny_lm

    out = Path(os.environ.get("PEAKPROBE_TINY_LM_DIR") or tmp_path_factory.mktemp("tiny-pythia"))
    return train_tiny_lm(out, progress=False)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="run the tests marked slow (as PEAKPROBE_SLOW=1 does)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("PEAKPROBE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: pass --runslow (or set PEAKPROBE_SLOW=1) to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads stall a busy machine:
    a module that asks for this runs its torch work on one thread, then restores the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- PEAKPROBE_REQUIRE: a skip for a missing extra that CI installed is a failure ---------------


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_required_skip(report) -> None:
    from helpers.extras import required_extra_of

    if report.skipped and (extra := required_extra_of(_skip_reason(report))):
        report.outcome = "failed"
        report.longrepr = (f"PEAKPROBE_REQUIRE names {extra!r}, yet this skipped: "
                           f"{_skip_reason(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_required_skip(outcome.get_result())
