#!/usr/bin/env bash
# One command for a machine with one CUDA GPU: the GPU-marked tests (compiled kernels, bfloat16 included) and
# the quick benchmark, in under 8 minutes, from a source checkout with torch and triton installed (no network;
# pytest, transformers and matplotlib are used when present).
#   usage: bash bench/gpu_check.sh OUT_DIR
# A machine without pytest can be given it as a folder of pure-Python packages:
#   pip install --no-deps --target .gpu_deps pytest pluggy iniconfig packaging pygments  (+ exceptiongroup
#   tomli on Python < 3.11)
# next to this checkout (.gpu_deps is git-ignored); it goes on PYTHONPATH when present.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)   # absolute: the script moves to the checkout's root
cd "$(dirname "$0")/.."
deps=""
[ -d .gpu_deps ] && deps="$PWD/.gpu_deps"
export PYTHONPATH="$PWD${deps:+:$deps}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/environment.txt"
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print("device", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

# One pytest per test file, all at once: the GPU tests' time goes mostly into compiling kernel variants on the
# CPU, which then spreads over the cores (a correctness test times nothing, so sharing the GPU is harmless).
tests_rc=0
if python3 -c "import pytest" 2>/dev/null; then
  files=$(grep -l "mark.gpu" tests/test_*.py)
  pids=()
  for f in $files; do
    timeout 200 python3 -m pytest "$f" -m gpu -q -p no:cacheprovider > "$out/gpu_tests_$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"; rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || tests_rc=$rc   # 5: no test selected in that file
  done
  for f in $files; do
    echo "== $f"; tail -n 25 "$out/gpu_tests_$(basename "$f" .py).log"
  done | tee "$out/gpu_tests.log"
else
  echo "pytest is not installed: GPU tests skipped" | tee "$out/gpu_tests.log"
fi
timeout 260 python3 -m bench --quick --output-dir "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, benchmark exit $bench_rc" | tee -a "$out/environment.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
