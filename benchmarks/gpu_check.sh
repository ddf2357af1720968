#!/usr/bin/env bash
# GPU check of the Triton fast path (issue 7), for a session with a lent GPU (H200).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh        # from anywhere; OUT defaults to ./gpu_out
#
# 1. environment  -> $OUT/env.txt   (GPU, versions; missing Python packages installed from PyPI)
# 2. parity tests -> $OUT/parity.txt   (tests/test_triton_parity.py compiled on CUDA)
# 3. benchmark    -> $OUT/bench.txt, bench.json    (benchmarks/gpu.py: Pythia-160m and -1.4b)
# 4. attribution  -> $OUT/cost.txt                 (benchmarks/sweep_cost.py, Pythia-160m shape)
# 5. launch sweep -> $OUT/sweep.txt, sweep.json    (kernel only, if time is left)
# Every step has its own timeout; the whole run stays under 7 minutes. $OUT/summary.txt lists
# each step's exit status. Exit status: that of the parity tests (2 when there is no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
: > "$OUT/summary.txt"
step() { echo "$1 exit $2 after ${SECONDS}s" | tee -a "$OUT/summary.txt"; }

# 1. environment (pip only for what is missing; torch itself is never installed here)
missing=$("$PY" - <<'PYEOF'
import importlib.util
specs = {"triton": "triton", "transformers": "transformers>=5,<6", "pandas": "pandas",
         "pyarrow": "pyarrow", "pytest": "pytest", "scipy": "scipy", "tqdm": "tqdm",
         "accelerate": "accelerate"}
print(" ".join(s for m, s in specs.items() if importlib.util.find_spec(m) is None))
PYEOF
)
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  if [ -n "$missing" ]; then
    echo "installing from PyPI: $missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install --quiet --retries 0 --timeout 10 $missing 2>&1 | tail -n 5
  fi
  "$PY" - <<'PYEOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("triton", "transformers", "pandas", "pyarrow", "pytest", "numpy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", e)
PYEOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: nothing to check" | tee -a "$OUT/summary.txt"
  exit 2
fi

# 2. parity on CUDA
PEAKPROBE_TRITON_DEVICE=cuda timeout 140 "$PY" -m pytest tests/test_triton_parity.py -q \
  -p no:cacheprovider --durations=8 > "$OUT/parity.txt" 2>&1
parity=$?
tail -n 25 "$OUT/parity.txt"
step parity "$parity"

# 3. benchmark: both Pythia shapes, bf16, batch 8 x 2048
timeout 200 "$PY" benchmarks/gpu.py --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
bench=$?
cat "$OUT/bench.txt" | grep -v '^  ' || true
step benchmark "$bench"

# 4. the attribution's cost against the forward-only sweep, on the GPU (float32, default probes)
timeout 100 "$PY" benchmarks/sweep_cost.py --size 160m --device cuda --backend auto --rounds 2 \
  > "$OUT/cost.txt" 2>&1
step cost $?
cat "$OUT/cost.txt"

# 5. launch-configuration sweep of the kernel alone, in whatever time is left
left=$((400 - SECONDS))
if [ "$left" -gt 30 ]; then
  timeout "$left" "$PY" benchmarks/gpu.py --kernel-only --sweep --no-progress \
    --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  step sweep $?
  cat "$OUT/sweep.txt"
else
  echo "sweep skipped: ${left}s left" | tee -a "$OUT/summary.txt"
fi
exit "$parity"
