"""The probed forward never holds a T x T score matrix per head: its extra memory stays far
below one such matrix at T = 2048 (measured in a fresh process by benchmarks/memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_probe_memory_is_linear_not_quadratic_in_t():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--lengths", "512", "2048", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    res = {int(k): v for k, v in json.loads(out.stdout).items()}
    big = res[2048]
    # One full (H, T, T) float32 score matrix is 128 MB here. The chunked probe holds about ten
    # (H, chunk, T) float32 temporaries of 2 MB each at once: linear in T.
    block_mb = 8 * 32 * 2048 * 4 / 2**20
    assert big["extra_mb"] < 16 * block_mb < 0.3 * big["full_scores_mb"]
    # From T = 512 to 2048 a quadratic cost grows 16x, a linear one 4x.
    assert big["extra_mb"] < 8 * max(res[512]["extra_mb"], block_mb / 2)
