#!/usr/bin/env bash
# The speed measurements of this folder, on one H200 (a 1-GPU proxy of the 2-GPU reference config: 32 prompts x 4
# samples = 128 sequences, one rank's share of the reference's 64 prompts). Each call measures the code's earlier
# behaviour ("before": the old-log-prob pass always run, vLLM returning the sampled tokens' log-probs) beside the
# new defaults, in the same call on the same host, 8 steps each:
#   bash results/reference/h200-speed-20261123/speed.sh bench     # vLLM with/without log-probs (benchmarks/vllm_sampling.py)
#   bash results/reference/h200-speed-20261123/speed.sh grpo2     # GRPO ZeRO-2: before, after, after at micro 32 + ckpt
#   bash results/reference/h200-speed-20261123/speed.sh grpo3     # GRPO ZeRO-3: before, after, after at micro 32 + ckpt
#   bash results/reference/h200-speed-20261123/speed.sh ppo       # PPO zero2 (32 sequences): before, after
# Runs from the project root with zbench importable and GSM8K in $GSM8K_DIR (as results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
gpu=results/reference/gpu.sh
proxy=(--set rollout.backend=vllm --set rollout.kv_cache_fit=true
       --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
before=(--set actor.recompute_old_log_prob=always --set rollout.log_probs=true)
export RUN_BUDGET_S=${RUN_BUDGET_S:-170}
case ${1:-} in
bench)
  bash $gpu prep
  python3 benchmarks/vllm_sampling.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
    --prompts 32 --n 4 --new-tokens 512 2>&1 | grep -v '^\(INFO\|WARNING\|DEBUG\)' | tee "$out/vllm_sampling.log" | grep '^{'
  wait; sleep 1; while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  bash $gpu pack-ops
  ;;
grpo2)
  bash $gpu prep
  RUN_TAG=z2-before bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" "${before[@]}"
  RUN_TAG=z2-after bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}"
  RUN_TAG=z2-after-mb32-ckpt bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  ;;
grpo3)
  bash $gpu prep
  RUN_TAG=z3-before bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" "${before[@]}" \
    --set actor.micro_batch_size_per_gpu=16
  RUN_TAG=z3-after bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" --set actor.micro_batch_size_per_gpu=16
  RUN_TAG=z3-after-mb32-ckpt bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  ;;
ppo)
  bash $gpu prep
  RUN_TAG=ppo-before bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}" "${before[@]}"
  RUN_TAG=ppo-after bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}"
  ;;
*)
  echo "unknown step ${1:-}: bench | grpo2 | grpo3 | ppo" >&2; exit 2
  ;;
esac
