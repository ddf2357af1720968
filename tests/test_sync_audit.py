"""No host synchronisation per attention layer on the CUDA path (benchmarks/sync_audit.py).

The audit runs the path CUDA takes (the Triton kernel, under its CPU interpreter) in a fresh
process and counts, per attention layer, the aten ops that make a host wait for a GPU. Its
counter is itself checked on planted syncs, so a path that gained one would fail here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import missing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_counter_sees_planted_syncs():
    from sync_audit import Audit

    mode = Audit()
    with mode:
        mode.phase = "layer"
        x = torch.arange(6.0)
        x.sum().item()  # _local_scalar_dense
        bool(x.max() > 1)  # is_nonzero / _local_scalar_dense
        torch.nonzero(x)
        x * 2  # not a sync
    assert mode.syncs["layer"] >= 3 and mode.ops["layer"] >= 4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason=missing("triton", "triton is not installed"))
@pytest.mark.parametrize("arch", ["llama_gqa", "gemma2_softcap"])
def test_no_host_sync_per_attention_layer(arch):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_audit.py"), "--json", "--arch", arch],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["layers"] > 0 and out["kernel_layers"] == out["layers"]
    assert out["syncs_per_layer"] == 0 and out["lm_head_syncs"] == 0
    assert out["batch_end_syncs"] <= 1  # the batch's one check of the kernel's key ranges
