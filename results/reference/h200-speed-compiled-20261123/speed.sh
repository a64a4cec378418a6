#!/usr/bin/env bash
# Whole GRPO / PPO steps on one H200 (a 1-GPU proxy of the 2-GPU reference config: 32 prompts per step, one rank's
# share of the reference's 64), before and after the fused LM head with compiled reductions and the compiled
# decoder layers, in the same call on the same host, 8 steps each:
#   bash results/reference/h200-speed-compiled-20261123/speed.sh grpo   # GRPO ZeRO-2 before / after, ZeRO-3 after
#   bash results/reference/h200-speed-compiled-20261123/speed.sh more   # GRPO ZeRO-2 after at micro 32 + ckpt; ZeRO-3
#                                                                       # before; PPO zero2 before
#   bash results/reference/h200-speed-compiled-20261123/speed.sh ppo    # PPO zero2 after: micro 32 + ckpt, micro 16
#   bash results/reference/h200-speed-compiled-20261123/speed.sh aligned   # GRPO ZeRO-2 and PPO zero2 at micro 32 +
#                                                                       # ckpt, widths aligned to 8
# "before" is the engine's previous defaults (plain head, eager layers: `model.fused_head=false
# model.compile_layers=never`) at the geometry the earlier speed runs used; "after" is the new defaults at the
# geometry the update benchmark (results/reference/h200-update-20261123) found fastest per stage.
# Runs from the project root with zbench and vLLM importable and GSM8K in $GSM8K_DIR (as results/reference/gpu.sh).
set -uo pipefail
gpu=results/reference/gpu.sh
proxy=(--set rollout.backend=vllm --set rollout.kv_cache_fit=true
       --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
before=(--set model.fused_head=false --set model.compile_layers=never)
export RUN_BUDGET_S=${RUN_BUDGET_S:-175}
case ${1:-} in
grpo)
  bash $gpu prep
  RUN_TAG=z2-before bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" "${before[@]}"
  RUN_TAG=z2-after bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" --set actor.micro_batch_size_per_gpu=16
  RUN_TAG=z3-after bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=64 --set model.gradient_checkpointing=true
  ;;
more)
  bash $gpu prep
  RUN_TAG=z2-after-mb32-ckpt bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  RUN_TAG=z3-before bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" "${before[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  RUN_TAG=ppo-before bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}" "${before[@]}"
  ;;
ppo)
  bash $gpu prep
  RUN_TAG=ppo-after-mb32-ckpt bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}" --set model.gradient_checkpointing=true \
    --set actor.micro_batch_size_per_gpu=32 --set critic.micro_batch_size_per_gpu=32
  RUN_TAG=ppo-after-mb16 bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=16 --set critic.micro_batch_size_per_gpu=16
  ;;
aligned)  # after micro-batch widths were aligned to 8 for the compiled layers (no recompile mid-run)
  bash $gpu prep
  RUN_TAG=z2-after-mb32-ckpt-aligned bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  RUN_TAG=ppo-after-mb32-ckpt-aligned bash $gpu run six-case zero2_no_offload 8 "${proxy[@]}" \
    --set model.gradient_checkpointing=true --set actor.micro_batch_size_per_gpu=32 --set critic.micro_batch_size_per_gpu=32
  ;;
*)
  echo "unknown step ${1:-}: grpo | more | ppo | aligned" >&2; exit 2
  ;;
esac
