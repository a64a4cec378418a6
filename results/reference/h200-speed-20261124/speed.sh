#!/usr/bin/env bash
# ZeRO-3 with compiled layers (decoder layers as DeepSpeed leaf modules, each layer's forward compiled) and where a
# colocated vLLM rollout spends its time, on one GPU (a 1-GPU proxy of the 2-GPU reference config: 32 prompts per
# step x 4 samples = 128 sequences, one rank's share of the reference's 64 prompts):
#   bash results/reference/h200-speed-20261124/speed.sh update   # GPU tests of the compiled paths, then the actor
#                                                                # update alone at ZeRO-2 / ZeRO-3 geometries
#   bash results/reference/h200-speed-20261124/speed.sh vllm VARIANT_JSON...  # benchmarks/vllm_profile.py per variant
#   bash results/reference/h200-speed-20261124/speed.sh steps    # whole GRPO / PPO steps at the defaults
# Runs from the project root with zbench (and vLLM for `vllm`, `steps`) importable and GSM8K in $GSM8K_DIR
# (as results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
gpu=results/reference/gpu.sh
proxy=(--set rollout.backend=vllm --set rollout.kv_cache_fit=true
       --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
export RUN_BUDGET_S=${RUN_BUDGET_S:-175}
case ${1:-} in
update)
  bash $gpu prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compile_layers.py tests/test_lm_head.py 2>&1 \
    | tail -n 15 | tee "$out/pytest-gpu.txt"
  s2=zero.stage=2; s3=zero.stage=3; ck=model.gradient_checkpointing=true
  never=model.compile_layers=never; always=model.compile_layers=always
  mb() { echo "actor.micro_batch_size_per_gpu=$1"; }
  python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet --seqs 128 --n 4 \
    --response-len 512 --repeats 3 \
    --variant "z2-mb32-ckpt-compiled:$s2,$(mb 32),$ck" \
    --variant "z3-mb64-ckpt-eager:$s3,$(mb 64),$ck,$never" \
    --variant "z3-mb64-ckpt-compiled:$s3,$(mb 64),$ck,$always" \
    --variant "z3-mb16-compiled:$s3,$(mb 16),$always" \
    2>&1 | tee "$out/update.log" | grep '^{' | tee "$out/update.jsonl"
  ;;
vllm)
  shift
  bash $gpu prep > "$out/prep.log" 2>&1
  for v in "$@"; do
    python3 benchmarks/vllm_profile.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet --prompts 32 \
      --n 4 --new-tokens 512 --repeats 3 --variant "$v" 2>> "$out/vllm_profile.log" | tee -a "$out/vllm_profile.jsonl"
  done
  ;;
steps)
  bash $gpu prep > "$out/prep.log" 2>&1
  # ZeRO-3's step 1 compiles its layers for about 90 s: each run gets 230 s
  RUN_BUDGET_S=230 RUN_TAG=z3 bash $gpu run grpo-six-case zero3_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=64 --set model.gradient_checkpointing=true
  RUN_BUDGET_S=230 RUN_TAG=z2 bash $gpu run grpo-six-case zero2_no_offload 8 "${proxy[@]}" \
    --set actor.micro_batch_size_per_gpu=32 --set model.gradient_checkpointing=true
  ;;
*)
  echo "unknown step ${1:-}: update | vllm | steps" >&2; exit 2
  ;;
esac
