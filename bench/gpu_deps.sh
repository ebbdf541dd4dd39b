#!/usr/bin/env bash
# Fill .gpu_deps/ (git-ignored) with the pure-Python packages the GPU check needs and the GPU machine lacks.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash bench/gpu_deps.sh [--check-only]

Run on a machine with PyPI access (this CPU machine), before sending the checkout to a GPU machine that has no
network. Installs into .gpu_deps/, without dependencies (the GPU image brings its own torch and triton):
  pytest, pytest-timeout, pytest-xdist, execnet,  the GPU-marked tests (bench/gpu_check.sh, stage "tests";
  pluggy, iniconfig, packaging, pygments          pytest.ini requires pytest-timeout and pytest-xdist)
  liger-kernel, cut-cross-entropy,                 the kernel suite's peers (stage "kernels"); einops is
  disentangled-flash, flashdeberta, einops         flashdeberta's one dependency the GPU image may lack
and, as wheels in .gpu_deps/wheels/ (unpacked by the GPU check for its end-to-end stage only):
  transformers, huggingface-hub                   a transformers that keeps padding-free sequences apart (5.25+),
                                                  for the padding-free baselines, whatever release the image has
then checks that `PYTHONPATH=.gpu_deps python -c "import liger_kernel, cut_cross_entropy, disentangled_flash,
flashdeberta, pytest, pytest_timeout, xdist"` works here, and that the wheels' transformers imports unpacked, and
prints the folder's size, which must stay well under the 64 MB a GPU run may carry.
flash-attn is not among them: it is a CUDA build, not pure Python; its rows say "not installed" unless the GPU
image has it. bench/gpu_check.sh puts .gpu_deps on PYTHONPATH when it exists; send it along, e.g. with the
device tool's carry: [".gpu_deps"].

  --check-only   only check an existing .gpu_deps/ (imports and size)
EOF
}

# Pinned: the peers' numbers are comparable from one GPU run to the next.
PACKAGES=(pytest==9.2.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 execnet==2.1.2 pluggy==1.7.0 iniconfig==2.3.1
          packaging==26.3 pygments==2.21.0
          liger-kernel==0.8.5 cut-cross-entropy==25.1.1 disentangled-flash==1.1.1 flashdeberta==0.0.8 einops==0.8.2)
# Carried as wheels (14 MB; unpacked, transformers alone is over 60 MB), the newest release the index has.
WHEELS=(transformers==5.25.0 huggingface-hub==2.4.0)
LIMIT_MB=40

check_only=0
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --check-only) check_only=1 ;;
  "") ;;
  *) echo "gpu_deps.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
deps=.gpu_deps

if [ "$check_only" = 0 ]; then
  tmp=$(mktemp -d "$deps.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  if ! python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$tmp" \
      "${PACKAGES[@]}"; then
    echo "gpu_deps.sh: pip could not install ${PACKAGES[*]} (is PyPI reachable?)" >&2
    exit 1
  fi
  if ! python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --dest "$tmp/wheels" "${WHEELS[@]}"; then
    echo "gpu_deps.sh: pip could not download ${WHEELS[*]} (is PyPI reachable?)" >&2
    exit 1
  fi
  rm -rf "$tmp/bin"
  rm -rf "$deps" && mv "$tmp" "$deps"   # replaced whole: no stale package survives a version change
  trap - EXIT
fi
[ -d "$deps" ] || { echo "gpu_deps.sh: no $deps/ folder (run without --check-only first)" >&2; exit 1; }
imports="import liger_kernel, cut_cross_entropy, disentangled_flash, flashdeberta, pytest, pytest_timeout, xdist"
if ! PYTHONPATH="$deps" python3 -c "$imports"; then
  echo "gpu_deps.sh: the packages in $deps/ do not import here" >&2
  exit 1
fi
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
for wheel in "$deps"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$unpacked"; done
if ! release=$(PYTHONPATH="$unpacked" python3 -c "import transformers
from transformers import BertForMaskedLM, DataCollatorWithFlattening
print(transformers.__version__)"); then
  echo "gpu_deps.sh: the transformers of $deps/wheels/ does not import here" >&2
  exit 1
fi
size_kb=$(du -sk "$deps" | cut -f1)
echo "gpu_deps.sh: $deps/ holds ${PACKAGES[*]} and wheels of ${WHEELS[*]} (transformers $release imports):" \
  "$((size_kb / 1024)).$(((size_kb % 1024) * 10 / 1024)) MB"
if [ "$size_kb" -gt $((LIMIT_MB * 1024)) ]; then
  echo "gpu_deps.sh: $deps/ is over $LIMIT_MB MB; a GPU run carries 64 MB in all" >&2
  exit 1
fi
