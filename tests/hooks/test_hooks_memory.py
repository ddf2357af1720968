"""The probed forward never holds a T x T score matrix per head: its extra memory grows linearly
in T and stays far below one such matrix (measured in a fresh process by benchmarks/memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_probe_memory_is_linear_not_quadratic_in_t():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--lengths", "512", "2048", "4096",
         "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    res = {int(k): v for k, v in json.loads(out.stdout).items()}
    # Live tensor bytes are counted exactly, so the growth law can be checked tightly: from
    # T = 512 to 2048 a linear cost grows 4x, a quadratic one 16x.
    growth = res[2048]["extra_live_mb"] / res[512]["extra_live_mb"]
    assert 3.5 < growth < 4.5
    # One (H, chunk, T) float32 block is 4 MB at T = 4096; the probe holds a handful of them,
    # against 512 MB for one full (H, T, T) score matrix.
    big = res[4096]
    block_mb = 8 * 32 * 4096 * 4 / 2**20
    assert big["extra_live_mb"] < 8 * block_mb < 0.1 * big["full_scores_mb"]
    # What the process really used (allocator caching included, noisy by some MB) agrees.
    assert big["extra_rss_mb"] < 0.15 * big["full_scores_mb"]
