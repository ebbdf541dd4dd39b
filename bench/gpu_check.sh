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

tests_rc=0
if python3 -c "import pytest" 2>/dev/null; then
  timeout 200 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
else
  echo "pytest is not installed: GPU tests skipped" | tee "$out/gpu_tests.log"
fi
timeout 260 python3 -m bench --quick --output-dir "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, benchmark exit $bench_rc" | tee -a "$out/environment.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
