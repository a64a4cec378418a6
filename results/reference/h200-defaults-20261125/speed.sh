#!/usr/bin/env bash
# Whole GRPO and PPO steps at the GPU defaults (no batch-geometry --set: `zbench.config.cuda_defaults` picks
# activation checkpointing, micro-batches by tokens, the largest forward micro-batch and vLLM's fitted KV cache),
# on one GPU: a 1-GPU proxy of the 2-GPU reference config (32 prompts per step, one rank's share of 64):
#   bash results/reference/h200-defaults-20261125/speed.sh prep
#   bash results/reference/h200-defaults-20261125/speed.sh grpo   # grpo-six-case zero3, then zero2, 10 steps each
#   bash results/reference/h200-defaults-20261125/speed.sh ppo    # six-case zero1 and zero2, 10 steps each
# Runs from the project root with zbench and vLLM importable and GSM8K in $GSM8K_DIR (as results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
gpu=results/reference/gpu.sh
proxy=(--set rollout.backend=vllm --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
case ${1:-} in
prep)
  bash $gpu prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  ;;
grpo)
  # ZeRO-3's step 1 compiles its leaf layers (75-110 s)
  RUN_BUDGET_S=${Z3_BUDGET_S:-300} RUN_TAG=z3 bash $gpu run grpo-six-case zero3_no_offload 10 "${proxy[@]}"
  RUN_BUDGET_S=${Z2_BUDGET_S:-240} RUN_TAG=z2 bash $gpu run grpo-six-case zero2_no_offload 10 "${proxy[@]}"
  ;;
ppo)
  RUN_BUDGET_S=${PPO_BUDGET_S:-500} bash $gpu run six-case zero1_no_offload,zero2_no_offload 10 "${proxy[@]}"
  ;;
*)
  echo "unknown step ${1:-}: prep | grpo | ppo" >&2; exit 2
  ;;
esac
