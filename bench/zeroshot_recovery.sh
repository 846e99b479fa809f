#!/usr/bin/env bash
# The zero-shot accuracy, LoRA recovery and deployment figures of docs/results.md, on the default model (SmolLM2-135M-Instruct), CPU.
# Needs runs/pg30 and runs/pg50 from:
#   python -m engine prune --prune-ratio 0.3 --steps 40 --lr 0.02 --max-windows 64 --out runs/pg30   (and 0.5 -> runs/pg50)
# Usage: [LIMIT=50] [RATIOS="30 50"] bash bench/zeroshot_recovery.sh STAGE   (stages: faith dense pruned finetune after measure)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LIMIT=${LIMIT:-50}
RATIOS=${RATIOS:-30 50}  # which pruned runs (runs/pgR) the stages pruned, finetune, after use
TASKS=piqa,hellaswag,winogrande,arc_easy,arc_challenge
O=runs/zeroshot_recovery
mkdir -p $O
case "$1" in
  faith)  # our path on the default model vs lm-eval's own CLI on a plain safetensors copy of the same weights
    python bench/plain_copy.py $O/smollm2-plain
    python -m engine zeroshot --write-tasks $O/tasks
    python -m lm_eval --model hf --model_args pretrained=$O/smollm2-plain,dtype=float32 --device cpu \
        --include_path $O/tasks --tasks arc_easy,piqa --limit $LIMIT --batch_size 8 --output_path $O/faith-lmeval ;;
  dense)
    python -m engine zeroshot --model smollm2-135m-instruct --tasks $TASKS --limit $LIMIT --out $O/zs-dense ;;
  pruned)
    for r in $RATIOS; do python -m engine zeroshot --model runs/pg$r/model --tasks $TASKS --limit $LIMIT --out $O/zs-pg$r; done ;;
  finetune)
    for r in $RATIOS; do
      python -m engine finetune --model runs/pg$r/model --out runs/pg$r-ft --samples 128 --seqlen 256 --batch-size 4 \
          --grad-accum 2 --lr 5e-4 --max-windows 64
    done ;;
  after)
    for r in $RATIOS; do python -m engine zeroshot --model runs/pg$r-ft/model --tasks $TASKS --limit $LIMIT --out $O/zs-pg$r-ft; done ;;
  measure)
    python -m engine measure --model smollm2-135m-instruct --compare runs/pg30/model --compare runs/pg50/model \
        --batch-size 1 --seqlen 128 --new-tokens 32 --repeats ${REPEATS:-5} --threads ${THREADS:-2} --out $O/measure ;;
esac
