#!/usr/bin/env bash
# The GPU check of the probes, for a session with a lent GPU (one H100 / H200): one script,
# under 8 minutes, every step with its own timeout.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh        # from anywhere; OUT defaults to ./gpu_out
#
# 1. env         -> $OUT/env.txt      GPU, driver, versions (missing packages from PyPI)
# 2. syncs       -> $OUT/syncs.txt    the engine's attention layers and LM head under
#                                     torch.cuda.set_sync_debug_mode("error")
# 3. parity      -> $OUT/parity.txt   tests/test_triton_parity.py compiled on CUDA
# 4. benchmark   -> $OUT/bench.txt, bench.json   benchmarks/gpu.py: probed / sdpa and peak memory
#                                     for the Pythia-160m and 1.4b shapes (bf16, batch 8 x 2048),
#                                     per layer sdpa / kernel / torch-path ms, LM-head ms
# 5. attribution -> $OUT/cost.txt     benchmarks/sweep_cost.py, Pythia-160m shape, bf16
# 6. launches    -> $OUT/sweep.txt    the kernel under other launch configurations, if time is left
# $OUT/summary.txt lists each step's exit status. Exit status: the parity tests' (2: no GPU).
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
         "accelerate": "accelerate", "filelock": "filelock", "jinja2": "jinja2",
         "matplotlib": "matplotlib", "datasets": "datasets"}
print(" ".join(s for m, s in specs.items() if importlib.util.find_spec(m) is None))
PYEOF
)
{
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

# 2. host synchronisations per layer (the first call compiles the kernel)
timeout 120 "$PY" benchmarks/sync_audit.py --cuda > "$OUT/syncs.txt" 2>&1
step syncs $?
cat "$OUT/syncs.txt"

# 3. parity on CUDA
PEAKPROBE_TRITON_DEVICE=cuda timeout 150 "$PY" -m pytest tests/test_triton_parity.py -q \
  -p no:cacheprovider --durations=5 > "$OUT/parity.txt" 2>&1
parity=$?
tail -n 12 "$OUT/parity.txt"
step parity "$parity"

# 4. benchmark: both Pythia shapes, bf16, batch 8 x 2048 (no block-size variants: --chunks '')
timeout 150 "$PY" benchmarks/gpu.py --chunks '' --json "$OUT/bench.json" --no-progress \
  > "$OUT/bench.txt" 2>&1
step benchmark $?
cat "$OUT/bench.txt"

# 5. the attribution's cost against the forward-only sweep (lockstep head searches, bf16)
timeout 90 "$PY" benchmarks/sweep_cost.py --size 160m --device cuda --backend auto --dtype bfloat16 \
  --rounds 1 --windows 32 > "$OUT/cost.txt" 2>&1
step cost $?
cat "$OUT/cost.txt"

# 6. launch configurations of the kernel alone, in whatever time is left
left=$((440 - SECONDS))
if [ "$left" -gt 30 ]; then
  timeout "$left" "$PY" benchmarks/gpu.py --kernel-only --sweep --no-progress \
    --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  step sweep $?
  cat "$OUT/sweep.txt"
else
  echo "sweep skipped: ${left}s left" | tee -a "$OUT/summary.txt"
fi
exit "$parity"
