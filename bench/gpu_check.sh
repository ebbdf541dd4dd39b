#!/usr/bin/env bash
# The GPU check: correctness and numbers from one GPU machine in a fixed time budget. See --help.
set -uo pipefail

usage() {
  cat <<'EOF'
usage: bash bench/gpu_check.sh OUT_DIR [--budget SECONDS] [--stages LIST] [--keep-raw]
       bash bench/gpu_check.sh --dry-run [--budget SECONDS] [--stages LIST]

Runs, from a source checkout (PYTHONPATH=., no install, no network), these stages in this order:
  smoke    python -m bertfuse.bench.smoke: every kernel forward and backward once at a BERT-base shape in bfloat16
           and float16, and a BERT-base step on the triton backend against the torch backend (checks in
           parallel processes, which also fills Triton's compile cache for the later stages)
  tests    the GPU-marked tests, one pytest per test file, all at once (their time is mostly compilation)
  e2e      bert-bench --suite e2e --quick: BERT-base pre-training steps, ours against transformers padded
           (eager, compiled), padding-free (DataCollatorWithFlattening; SDPA, flex attention, flash attention
           where installed; eager and compiled) and the fused transformers model, most important first (four
           fifths of the stage), on the transformers carried in .gpu_deps/wheels (5.25+, which keeps
           padding-free sequences apart) where it imports, else the image's, whose padding-free rows are then
           left out with the reason; then bert-bench --suite encode: forward-only encoding, eager, compiled and
           fused, batch 1/32/256; then bert-bench --suite qa: a BERT-base question-answering fine-tuning step on
           SQuAD-shaped padded batches, unfused, fused exact and fused with padded_positions="zero"
  kernels  bert-bench --suite kernels --quick: each kernel against torch eager, torch.compile and the peers
           (varlen_attn, SDPA masked and nested, flash-attn when installed; Liger-Kernel's LayerNorm and fused
           linear cross-entropy, Cut Cross-Entropy, from .gpu_deps), each row with its error to float64
  tune     python -m bertfuse.bench.tune: launch configs measured on this GPU for the problems the committed table
           (kernels/configs/) lacks, written with the committed entries to the archive's configs/ folder
Each stage gets a share of the budget (smoke 20%, tests 15%, e2e 35%, kernels 20%, tune 10%, among the stages
chosen; time a stage leaves unused passes to the next) and is stopped when it runs over, keeping what it wrote.

OUT_DIR ends up holding summary.md (targets met or not, failures, environment: the GPU, its family, e.g. sm_80 or
gfx942, and the name its results are filed under in bench/results/, e.g. nvidia-a100-sxm4-80gb) and
all.tar.gz (every log, CSV, JSON and plot, and the tuned table); both are rewritten after every stage. The raw
files are in OUT_DIR/raw until then, and are removed after packing unless --keep-raw is given.

  --budget SECONDS  total time for the stages (default 480)
  --stages LIST     comma-separated subset, e.g. smoke or smoke,tests (default: all five)
  --keep-raw        keep OUT_DIR/raw after packing
  --dry-run         print each stage's time and what it will run (the end-to-end rows, with the transformers
                    they will run on), run nothing; needs no OUT_DIR and no GPU

Without a GPU it runs the same stages on the CPU: smoke in Triton's interpreter at small shapes, the GPU tests
all skipped, the benchmarks on the torch path, tune skipped. A GPU machine without network gets pytest and the
kernel suite's peers as a folder of pure-Python packages next to this checkout (.gpu_deps, git-ignored, put on
PYTHONPATH): run `bash bench/gpu_deps.sh` here first and send .gpu_deps along with the checkout.
EOF
}

command="bash bench/gpu_check.sh $*"
out="" budget=480 stages="smoke,tests,e2e,kernels,tune" keep_raw=0 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --stages) stages=${2:?--stages needs a list}; shift 2 ;;
    --keep-raw) keep_raw=1; shift ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: one OUT_DIR only (see --help)" >&2; exit 2; }; out=$1; shift ;;
  esac
done
[ -n "$out" ] || [ "$dry_run" = 1 ] || { usage >&2; exit 2; }
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget must be whole seconds, got $budget" >&2; exit 2; }
# The end-to-end stage holds the headline comparisons (ours against transformers padded and padding-free), so it
# has the largest share; the tests, mostly compilation, and tuning, which only adds table entries, give way.
declare -A share=([smoke]=20 [tests]=15 [e2e]=35 [kernels]=20 [tune]=10)
IFS=, read -ra chosen <<< "$stages"
total_share=0
for s in "${chosen[@]}"; do
  [ -n "${share[$s]:-}" ] || { echo "gpu_check.sh: unknown stage '$s' (smoke, tests, e2e, kernels, tune)" >&2; exit 2; }
  total_share=$((total_share + share[$s]))
done

if [ "$dry_run" = 0 ]; then
  mkdir -p "$out" && out=$(cd "$out" && pwd)   # absolute: the script moves to the checkout's root
fi
cd "$(dirname "$0")/.."
deps=""
[ -d .gpu_deps ] && deps="$PWD/.gpu_deps"
export PYTHONPATH="$PWD${deps:+:$deps}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# The end-to-end stage's transformers: the wheels carried in .gpu_deps/wheels, unpacked outside OUT_DIR (they are
# not results), where they import; else the image's own, named with the reason.
hf_dir=$(mktemp -d) && trap 'rm -rf "$hf_dir"' EXIT
e2e_path=$PYTHONPATH
if ls .gpu_deps/wheels/transformers-*.whl > /dev/null 2>&1; then
  for wheel in .gpu_deps/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$hf_dir"; done
  if e2e_hf=$(PYTHONPATH="$hf_dir:$PYTHONPATH" python3 -c "import transformers
from transformers import BertForMaskedLM, DataCollatorWithFlattening
print(transformers.__version__)" 2> "$hf_dir.err"); then
    e2e_path="$hf_dir:$PYTHONPATH" e2e_hf="$e2e_hf (carried in .gpu_deps/wheels)"
  else
    e2e_hf="the image's: the carried wheels do not import ($(tail -n 1 "$hf_dir.err"))"
  fi
  rm -f "$hf_dir.err"
else
  e2e_hf="the image's: no transformers wheel in .gpu_deps/wheels (bash bench/gpu_deps.sh)"
fi
if [ "$dry_run" = 0 ]; then
  e2e_hf="$e2e_hf; image: $(python3 -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -n 1)"
fi

if [ "$dry_run" = 1 ]; then   # the plan: each stage's time and, for e2e, the rows bert-bench will run on a GPU
  total_share=0
  for s in "${chosen[@]}"; do total_share=$((total_share + share[$s])); done
  echo "Dry run: stages ${stages} in a budget of ${budget} s; the end-to-end stage's transformers: $e2e_hf"
  for s in smoke tests e2e kernels tune; do
    [[ ",$stages," == *",$s,"* ]] || continue
    echo "== stage $s: about $(( budget * share[$s] / total_share )) s (plus what earlier stages leave)"
    if [ "$s" = e2e ]; then
      PYTHONPATH="$e2e_path" python3 -m bertfuse.bench --suite e2e --quick --device cuda --dry-run || exit 1
    fi
  done
  exit 0
fi

raw="$out/raw"
rm -rf "$raw" && mkdir -p "$raw/tests"
python3 - "$raw/environment.json" "$command" "$e2e_hf" <<'PY' || exit 1
import json, os, platform, subprocess, sys, datetime
import torch
env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU: " + platform.machine() + ")",
       "torch": torch.__version__, "cuda": torch.version.cuda or "none", "python": platform.python_version()}
env["hip"] = torch.version.hip or "none"
try:
    import triton
    env["triton"] = triton.__version__
except ImportError:
    env["triton"] = "not installed"
if torch.cuda.is_available():  # the GPU family whose launch-config table the kernels read, and the results' name
    try:
        from bertfuse.kernels import targets
        t = targets.of(torch.device("cuda"))
        env["family"] = f"{t.name} ({t.gpus})"
    except Exception as e:  # an unsupported GPU still gets its environment written
        env["family"] = f"unknown ({type(e).__name__}: {e})"[:200]
    name = torch.cuda.get_device_name().lower()
    env["results_name"] = "-".join("".join(c if c.isalnum() else " " for c in name).split())
try:
    env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
env["command"] = sys.argv[2]
env["e2e_transformers"] = sys.argv[3]
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(" | ".join(f"{k} {v}" for k, v in env.items()))
PY
cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")

pack() {   # summary.md and all.tar.gz from what the stages wrote so far
  python3 -m bertfuse.bench.summary "$raw" "$out/summary.md" > /dev/null 2>> "$raw/summary_errors.log"
  cp "$out/summary.md" "$raw/summary.md" 2>/dev/null
  tar -czf "$out/all.tar.gz.tmp" -C "$raw" . && mv "$out/all.tar.gz.tmp" "$out/all.tar.gz"
}

gpu_tests() {   # one pytest per file with GPU-marked tests, in parallel, each cut at the stage's limit
  if ! python3 -c "import pytest, pytest_timeout, xdist" 2>/dev/null; then   # pytest.ini requires both plugins
    echo "pytest, pytest-timeout or pytest-xdist is not installed: GPU tests not run (see --help)"; return 1
  fi
  local limit=$1 rc=0 pids=() f
  for f in $(grep -l "mark.gpu" tests/test_*.py); do
    timeout --kill-after=5 "$limit" python3 -m pytest "$f" -m gpu -n 0 -q -p no:cacheprovider \
      > "$raw/tests/$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"; local r=$?
    [ "$r" = 0 ] || [ "$r" = 5 ] || rc=$r   # 5: no test selected in that file
  done
  tail -n 3 "$raw"/tests/*.log
  return $rc
}

start=$(date +%s) used_share=0 failed=0
for s in smoke tests e2e kernels tune; do
  [[ ",$stages," == *",$s,"* ]] || continue
  used_share=$((used_share + share[$s]))
  now=$(date +%s)
  allowed=$(( budget * used_share / total_share - (now - start) ))   # this stage's share plus what is left over
  [ "$allowed" -ge 10 ] || allowed=10
  echo "== stage $s: up to ${allowed} s"
  t0=$(date +%s)
  case $s in
    smoke) timeout --kill-after=5 "$allowed" python3 -m bertfuse.bench.smoke --json "$raw/smoke.json" ;;
    tests) gpu_tests "$((allowed - 5))" ;;
    e2e) t_end=$(( $(date +%s) + allowed ))   # the training steps, then forward-only encoding in what is left
         echo "transformers for the pre-training steps: $e2e_hf"
         PYTHONPATH="$e2e_path" timeout --kill-after=5 "$((allowed * 4 / 5))" \
           python3 -m bertfuse.bench --suite e2e --quick --output-dir "$raw/e2e"
         rc_e2e=$?
         left=$(( t_end - $(date +%s) > 20 ? t_end - $(date +%s) : 20 ))
         timeout --kill-after=5 "$(( left / 2 ))" \
           python3 -m bertfuse.bench --suite encode --quick --output-dir "$raw/encode"
         rc_encode=$?
         timeout --kill-after=5 "$(( t_end - $(date +%s) > 10 ? t_end - $(date +%s) : 10 ))" \
           python3 -m bertfuse.bench --suite qa --quick --output-dir "$raw/qa" && (exit $rc_e2e) && (exit $rc_encode) ;;
    kernels) timeout --kill-after=5 "$allowed" python3 -m bertfuse.bench --suite kernels --quick --output-dir "$raw/kernels" ;;
    tune) if [ "$cuda" = 1 ]; then   # continues the committed table: the result holds old and new entries
            mkdir -p "$raw/configs" && cp kernels/configs/*.json "$raw/configs/" 2>/dev/null
            timeout --kill-after=5 "$allowed" python3 -m bertfuse.bench.tune --budget "$((allowed * 3 / 4))" \
              --output "$raw/configs" --skip-existing
          else
            echo "no GPU: nothing to tune"; (exit 3)
          fi ;;
  esac > >(tee "$raw/$s.log") 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - t0 ))
  case $rc in
    0) status=ok ;;
    124|137) status=cut ;;
    3) status=skipped ;;
    *) status="failed (exit $rc)"; failed=1 ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$s" "$status" "$elapsed" "$allowed" >> "$raw/stages.tsv"
  echo "== stage $s: $status after ${elapsed} s"
  pack
done
cat "$out/summary.md"
[ "$keep_raw" = 1 ] || rm -rf "$raw"
exit $failed
