"""PEAKPROBE_REQUIRE: a test skipping for a missing extra fails when that extra is required."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

PLANTED = '''
import pytest
from helpers.extras import missing

pytestmark = pytest.mark.skipif(True, reason=missing("triton", "triton is not installed"))

def test_needs_triton():
    pass
'''

PLANTED_MODULE = '''
import pytest
from helpers.extras import missing

pytest.skip(missing("chromium", "no browser"), allow_module_level=True)

def test_needs_chromium():
    pass
'''

OTHER_SKIP = '''
import pytest

def test_skips_for_another_reason():
    pytest.skip("triton was imported without the interpreter here")
'''


def _run(folder: Path, require: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PEAKPROBE_REQUIRE"}
    if require is not None:
        env["PEAKPROBE_REQUIRE"] = require
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
           "--rootdir", str(folder), str(folder)]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("planted_skips")
    (folder / "test_marked.py").write_text(PLANTED)
    (folder / "test_module_level.py").write_text(PLANTED_MODULE)
    (folder / "test_other.py").write_text(OTHER_SKIP)
    return folder


def test_without_require_the_extras_skip(planted):
    out = _run(planted, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 skipped" in out.stdout


def test_a_required_extra_turns_its_skips_into_failures(planted):
    out = _run(planted, "triton")  # chromium is not required: its module-level skip stays one
    assert out.returncode == 1, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert "2 skipped, 1 error" in last, last  # a skip in setup fails as an error
    assert "PEAKPROBE_REQUIRE names 'triton', yet this skipped" in out.stdout


def test_a_required_extra_fails_a_module_level_skip_at_collection(planted):
    out = _run(planted, "chromium")
    assert out.returncode == 2, out.stdout + out.stderr  # a collection error interrupts the run
    assert "PEAKPROBE_REQUIRE names 'chromium', yet this skipped" in out.stdout


def test_an_unknown_extra_is_refused(planted):
    out = _run(planted, "tritn")
    assert out.returncode != 0
    assert "unknown extras ['tritn']" in out.stdout + out.stderr
