#!/usr/bin/env bash
# The GPU check of the probes in one device call (one H100 / H200): under 8 minutes, every step
# with its own timeout, its output written to $OUT line by line as it runs (unbuffered), at most
# 8 files under $OUT. Without a GPU it runs the steps a CPU can run and names those it skips.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh        # from anywhere; OUT defaults to ./gpu_out
#
# step         file                  on a GPU                          on CPU
# 1 env        env.txt               GPU, driver, versions             versions
# 2 audit      audit.txt             sync_audit.py --cuda (a probed    sync_audit.py (interpreter),
#                                    forward under sync debug "error"),  lm_head_bytes.py
#                                    lm_head_bytes.py
# 3 parity     parity.txt            tests/probes/test_triton_parity.py       needs a GPU (skipped)
#                                    compiled on CUDA (a subset sized
#                                    to its timeout)
# 4 benchmark  bench.txt, bench.json benchmarks/gpu.py, Pythia-160m    gpu.py --smoke
#                                    and 1.4b shapes, bf16, 8 x 2048:
#                                    probed / sdpa, memory ratio, ms
#                                    per layer (kernel, sdpa), LM-head
#                                    ms; 20 timed iterations (CUDA events)
# 5 cost       cost.txt              sweep_cost.py, Pythia-160m, bf16: needs a GPU (skipped)
#                                    attribution / forward-only sweep
# 6 launches   sweep.txt             the kernel under other launch     needs a GPU (skipped)
#                                    configurations, in the time left
# summary.txt: each step's exit status and time. Exit status: the parity step's (0 on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
BUDGET=460  # seconds for the whole script (the device call allows 600)
: > "$OUT/summary.txt"
note() { echo "$1" | tee -a "$OUT/summary.txt"; }
# run NAME SECONDS FILE CMD...: the command's output goes to FILE as it is written, and to stdout
run() {
  local name=$1 limit=$2 file=$3
  shift 3
  echo "== $name (timeout ${limit}s)" | tee -a "$OUT/$file"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/$file"
  local rc=${PIPESTATUS[0]}
  note "$name exit $rc after ${SECONDS}s"
  return "$rc"
}

# 1. environment (pip only for what is missing, and only where an index is reachable)
missing=$("$PY" - <<'PYEOF'
import importlib.util
specs = {"triton": "triton", "transformers": "transformers>=5,<6", "pandas": "pandas",
         "pyarrow": "pyarrow", "pytest": "pytest", "scipy": "scipy", "tqdm": "tqdm",
         "accelerate": "accelerate", "filelock": "filelock", "jinja2": "jinja2",
         "matplotlib": "matplotlib"}
print(" ".join(s for m, s in specs.items() if importlib.util.find_spec(m) is None))
PYEOF
)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  if [ -n "$missing" ]; then
    echo "missing: $missing (trying pip)"
    # shellcheck disable=SC2086
    timeout 60 "$PY" -m pip install --quiet --retries 0 --timeout 10 $missing 2>&1 | tail -n 3
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
} 2>&1 | tee "$OUT/env.txt"
note "env exit 0 after ${SECONDS}s"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  GPU=1
else
  GPU=0
  note "no CUDA device visible to $PY: CPU steps only (2 audit, 4 benchmark --smoke); steps 3 parity, 5 cost, 6 launches need a GPU"
fi

# 2. host synchronisations and the LM head's bytes per logit
if [ "$GPU" = 1 ]; then
  run audit 90 audit.txt "$PY" benchmarks/sync_audit.py --cuda
else
  run audit 150 audit.txt "$PY" benchmarks/sync_audit.py
fi
run lm_head_bytes 150 audit.txt "$PY" benchmarks/lm_head_bytes.py --seq 16

# 3. parity on CUDA: about 25 kernel variants to compile (a few seconds each), the architectures
# in bf16, sinks with softcapping, the Pythia head dims at T = 1000 in each dtype
if [ "$GPU" = 1 ]; then
  PEAKPROBE_TRITON_DEVICE=cuda run parity 150 parity.txt "$PY" -m pytest tests/probes/test_triton_parity.py \
    tests/probes/test_lm_head_kernel.py -v -p no:cacheprovider --durations=5 \
    -k "(architectures and bf16) or sinks_and_softcap or pythia_like or largest_logit or lm_head"
  parity=$?
else
  note "parity skipped: needs a GPU (on CPU: python -m pytest tests/probes/test_triton_parity.py tests/probes/test_lm_head_kernel.py)"
  parity=0
fi

# 4. benchmark: both Pythia shapes, bf16, batch 8 x 2048 (no block-size variants: --chunks '')
if [ "$GPU" = 1 ]; then
  run benchmark 170 bench.txt "$PY" benchmarks/gpu.py --chunks '' --json "$OUT/bench.json" --no-progress
else
  run benchmark 300 bench.txt "$PY" benchmarks/gpu.py --smoke --chunks '' --json "$OUT/bench.json" --no-progress
fi

# 5. the attribution's cost against the forward-only sweep (every site's search in lockstep, bf16)
if [ "$GPU" = 1 ]; then
  run cost 70 cost.txt "$PY" benchmarks/sweep_cost.py --size 160m --device cuda --backend auto \
    --dtype bfloat16 --rounds 1 --windows 32
else
  note "cost skipped: needs a GPU (on CPU: python benchmarks/sweep_cost.py)"
fi

# 6. launch configurations of the kernel alone, in whatever time is left
left=$((BUDGET - SECONDS))
if [ "$GPU" = 1 ] && [ "$left" -gt 30 ]; then
  run launches "$left" sweep.txt "$PY" benchmarks/gpu.py --kernel-only --sweep --no-progress
elif [ "$GPU" = 1 ]; then
  note "launches skipped: ${left}s left"
else
  note "launches skipped: needs a GPU"
fi
note "done after ${SECONDS}s; files: $(ls "$OUT" | wc -l) in $OUT"
exit "$parity"
