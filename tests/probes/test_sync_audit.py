"""The sync audit (benchmarks/sync_audit.py) counts every host synchronisation, and a probed
forward on the CUDA path makes none: one device-to-host copy per batch, at its end.

The audit's counters are checked on planted synchronisations: each of the eleven patterns
alone, against operations that do not synchronise, and planted inside a real probed forward
(an attention layer, the LM head, the hooks' glue), where the audit must count them in the
right phase.
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
from helpers.extras import missing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sync_audit  # noqa: E402

from peakprobe.hooks import engine, interface  # noqa: E402

#: pattern -> (what it does to x, the kind of synchronisation it is)
PLANTS = {
    "tolist": (lambda x: x.tolist(), "d2h"),
    "cpu": (lambda x: x.cpu(), "d2h"),
    "numpy": (lambda x: x.numpy(), "d2h"),
    "item": (lambda x: x.sum().item(), "d2h"),
    "to_cpu": (lambda x: x.to("cpu"), "d2h"),
    "bool_index": (lambda x: x[x > 0], "shape"),
    "nonzero": (lambda x: torch.nonzero(x), "shape"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), "shape"),
    "unique": (lambda x: torch.unique(x), "shape"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x.flatten()[:3], torch.tensor([1, 2, 0])), "shape"),
    "synchronize": (lambda x: _synchronize(), "sync"),
}


def _synchronize() -> None:
    """torch.cuda.synchronize where the audit wraps it (on CPU the real one raises: the warm-up
    batch runs outside the audit)."""
    if torch.cuda.is_available() or "Audit" in torch.cuda.synchronize.__qualname__:
        torch.cuda.synchronize()


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_each_planted_pattern_is_counted_once(name):
    plant, kind = PLANTS[name]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).detach()
    counted = sync_audit.Audit()
    with counted:
        counted.phase = "layer"
        plant(x)
    assert counted.count(("layer",)) == 1, counted.events
    assert counted.count(("layer",), (kind,)) == 1


def test_operations_that_do_not_synchronise_are_not_counted():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    counted = sync_audit.Audit()
    with counted:
        counted.phase = "layer"
        y = (x * 2).softmax(-1).to(x.device).to(torch.float64)
        x.new_zeros(3).to(device=x.device)
        torch.repeat_interleave(x, 2, dim=0)
        x[torch.tensor([0, 2])]
        torch.where(x > 0, x, 0.0).topk(2, -1)
        torch.stack([y.sum(), y.amax()])
    assert counted.events == []


def _inject(monkeypatch, module, function: str, plant) -> None:
    """Plant into ``module.function``, a function the phase's own code calls."""
    original = getattr(module, function)

    def planted(*args, **kwargs):
        plant(torch.arange(1.0, 5.0))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, planted)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_pattern_planted_in_every_layer_is_counted_per_layer(monkeypatch, name):
    """Planted in each attention layer's statistics: once per layer, in phase ``layer``."""
    _inject(monkeypatch, engine, "attention_head_sums", PLANTS[name][0])
    out = sync_audit.audit("llama", backend="torch")
    assert out["attention_calls"] == 2
    assert out["syncs_per_forward"] == 2, out["by_phase"]
    assert sum(out["by_phase"]["layer"].values()) == 2
    assert out["d2h_per_batch"] == 3  # and the batch's own copy at its end


@pytest.mark.parametrize(("module", "function", "phase", "n"), [
    (engine, "block_sums", "lm_head", 1),  # the LM head: one block of positions here
    (interface, "softmax_kwargs", "hooks", 2),  # the glue of each attention call
    (interface, "lm_targets", "hooks", 1),  # the glue of the LM head
])
def test_a_pattern_planted_in_the_lm_head_or_the_glue_is_counted(monkeypatch, module, function, phase, n):
    _inject(monkeypatch, module, function, PLANTS["tolist"][0])
    out = sync_audit.audit("llama", backend="torch")
    assert out["syncs_per_forward"] == n and out["by_phase"][phase] == {"d2h:tolist": n}, out["by_phase"]


def test_the_batch_end_is_one_copy_and_the_forward_none_on_the_torch_path():
    out = sync_audit.audit("llama", backend="torch")
    assert out["syncs_per_forward"] == 0 and out["d2h_per_batch"] == 1, out["by_phase"]
    assert out["by_phase"]["batch_end"] == {"d2h:tolist": 1}
    assert out["loss"] == out["loss"]  # the copy carries the loss (not NaN)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason=missing("triton", "triton is not installed"))
@pytest.mark.parametrize("arch", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_the_kernel_path_makes_no_sync_per_forward(arch):
    """The CUDA path (the kernel under Triton's interpreter), run as a user runs the script."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_audit.py"), "--json", "--arch", arch],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton" and out["attention_calls"] == 2
    assert out["syncs_per_forward"] == 0 and out["d2h_per_batch"] == 1, out["by_phase"]
