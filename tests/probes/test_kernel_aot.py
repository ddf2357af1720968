"""The attention-statistics kernel compiles for sm_90 (Hopper) without a GPU, with no register
spills and its QK^T tiles on the tensor cores (``benchmarks/kernel_aot.py --quick``: one
configuration per launch configuration and constexpr class).

Skipped when triton, or the ptxas / cuobjdump its wheel ships, is missing. The compilation runs
in a subprocess without ``TRITON_INTERPRET`` (this session may have set it for the parity
tests), about a minute of CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.extras import missing

# Located, not imported: importing triton here would make test_triton_parity.py (collected
# later) find it loaded without the interpreter.
_SPEC = importlib.util.find_spec("triton")
if _SPEC is None:
    pytest.skip(missing("triton", "triton is not installed"), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_aot.py"
BIN = Path(list(_SPEC.submodule_search_locations)[0]) / "backends" / "nvidia" / "bin"

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
        reason=missing("triton", "triton's ptxas / cuobjdump are not shipped here"),
    ),
]

LINE = re.compile(r"^config=(\S+) regs=(\d+) spill_bytes=(\d+) mma=(yes|no) instr_per_score=([\d.]+) "
                  r"ctas_per_sm=(\d+)$")


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr[-3000:]
    return run, json.loads(out.read_text())


def test_every_configuration_compiles_without_spills_and_with_mma(aot):
    run, results = aot
    lines = [m.groups() for m in map(LINE.match, run.stdout.splitlines()) if m]
    assert len(lines) == len(results) >= 18
    names = {name for name, *_ in lines}
    assert all(float(ips) > 1 and int(ctas) >= 1 for *_, ips, ctas in lines)
    for dtype, d in (("bf16", 64), ("bf16", 128), ("fp16", 64), ("fp16", 128), ("fp32", 64)):
        assert {f"{dtype}-d{d}", f"{dtype}-d{d}-softcap"} <= names
    bad = [(n, regs, spill, mma) for n, regs, spill, mma, *_ in lines if spill != "0" or mma != "yes"]
    assert not bad, bad
    assert all(r["shared_bytes"] <= 232448 for r in results), results  # 227 KiB per sm_90 block
    assert run.returncode == 0
