#!/usr/bin/env bash
# The runs of this folder, on one host with 2 NVIDIA H100s: the reference config itself (not a 1-GPU proxy):
# Qwen3-0.6B shape, GSM8K prompts, 64 prompts per step over 2 ranks (GRPO 4 samples each), 512 new tokens, bf16,
# vLLM 0.26 with the fitted KV cache, batch geometry from the GPU defaults. From the project root, with the kits of
# the GPU machine's README on the path:
#   bash results/reference/h100x2-20261125/session.sh update     # prep; the actor update alone with and without
#        model.head_loss_in_forward (1-GPU proxy, 128 x 512 tokens), one GPU per pair, side by side; the GPU tests
#   bash results/reference/h100x2-20261125/session.sh grpo CASE [--set k=v ...]  # grpo-six-case CASE, 10 steps,
#        then its bare-DeepSpeed floors on the same GPUs
#   bash results/reference/h100x2-20261125/session.sh ppo [--set k=v ...]        # six-case zero1 and zero2 likewise
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
step=${1:-}; shift || true
case $step in
update)
  bash $g prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  ck=model.gradient_checkpointing=true
  # each pair on one GPU, so the option is compared on the same card; the two GPUs run at once
  CUDA_VISIBLE_DEVICES=0 UPDATE_BUDGET_S=300 OUT="$out/g0" bash $g update \
    "z2-ckpt:zero.stage=2,actor.micro_batch_size_per_gpu=32,$ck" \
    "z2-ckpt-head:zero.stage=2,actor.micro_batch_size_per_gpu=32,$ck,model.head_loss_in_forward=true" \
    > "$out/update-g0.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 UPDATE_BUDGET_S=300 OUT="$out/g1" bash $g update \
    "z3-ckpt:zero.stage=3,actor.micro_batch_size_per_gpu=64,$ck" \
    "z3-ckpt-head:zero.stage=3,actor.micro_batch_size_per_gpu=64,$ck,model.head_loss_in_forward=true" \
    > "$out/update-g1.txt" 2>&1 &
  wait
  cat "$out"/g0/update.jsonl "$out"/g1/update.jsonl > "$out/update.jsonl"
  tar -czf "$out/update-logs.tgz" -C "$out" g0 g1 && rm -rf "$out/g0" "$out/g1"
  timeout 240 python3 -m pytest -q -m gpu tests/test_lm_head.py tests/test_compile_layers.py -p no:cacheprovider \
    2>&1 | tail -n 15 | tee "$out/pytest-gpu.txt"
  cut -c1-300 "$out/update.jsonl"
  ;;
grpo)
  case=$1; shift
  FLOOR=1 FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-150} RUN_BUDGET_S=${RUN_BUDGET_S:-360} RUN_TAG=${case%%_*} \
    bash $g run grpo-six-case "$case" 10 --set rollout.backend=vllm "$@" 2>&1 | tee "$out/grpo-$case.log"
  ;;
ppo)
  FLOOR=1 FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-150} RUN_BUDGET_S=${RUN_BUDGET_S:-400} \
    bash $g run six-case zero1_no_offload,zero2_no_offload 10 --set rollout.backend=vllm "$@" 2>&1 \
    | tee "$out/ppo.log"
  ;;
*)
  echo "unknown step $step: update | grpo CASE | ppo" >&2; exit 2
  ;;
esac
