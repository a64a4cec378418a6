#!/usr/bin/env bash
# Padding in the actor update, one GPU, the 1-GPU proxy of the reference GRPO config (32 prompts x 4 samples = 128
# sequences, 512 new tokens, Qwen3-0.6B shape with random weights):
#   python3 results/reference/h100-padding-20261125/varlen_probe.py   # packed attention against padded SDPA
#   bash results/reference/h100-padding-20261125/session.sh update    # prep; the update with rows sorted by length or not
#   bash results/reference/h100-padding-20261125/session.sh grpo      # GRPO ZeRO-2 and ZeRO-3, 10 steps, GPU defaults
#   bash results/reference/h100-padding-20261125/session.sh profile   # the update's kernels, sorted rows
#   bash results/reference/h100-padding-20261125/session.sh attention # flash against cuDNN attention
# Runs from the project root with zbench (and for `grpo` vLLM) importable and GSM8K in $GSM8K_DIR (as gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
gpu=results/reference/gpu.sh
case ${1:-} in
update)
  bash $gpu prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  s2=zero.stage=2; s3=zero.stage=3; ck=model.gradient_checkpointing=true; nock=model.gradient_checkpointing=false
  rows=trainer.sort_micro_batches=false; sorted=trainer.sort_micro_batches=true
  mb() { echo "actor.micro_batch_size_per_gpu=$1"; }
  timeout -s INT 420 python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
    --seqs 128 --n 4 --response-len 512 --repeats 3 \
    --variant "z2-mb32-ckpt-rows:$s2,$(mb 32),$ck,$rows" \
    --variant "z2-mb32-ckpt-sorted:$s2,$(mb 32),$ck,$sorted" \
    --variant "z3-mb64-ckpt-rows:$s3,$(mb 64),$ck,$rows" \
    --variant "z3-mb64-ckpt-sorted:$s3,$(mb 64),$ck,$sorted" \
    --variant "z2-mb32-rows:$s2,$(mb 32),$nock,$rows" \
    --variant "z2-mb32-sorted:$s2,$(mb 32),$nock,$sorted" \
    2>&1 | tee "$out/update.log" | grep '^{' | tee "$out/update.jsonl" | cut -c1-400
  bash $gpu pack-ops > /dev/null 2>&1
  ;;
profile)  # the update profiled at the default and at the tuned geometry, rows sorted (after `update`'s prep)
  [ -d /tmp/zbench-gsm8k ] || bash $gpu prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  timeout -s INT 300 python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
    --seqs 128 --n 4 --response-len 512 --repeats 2 --profile-dir "$out/profile" \
    --variant "z2-mb32-ckpt-sorted:zero.stage=2,actor.micro_batch_size_per_gpu=32,model.gradient_checkpointing=true" \
    --variant "z2-mb32-sorted:zero.stage=2,actor.micro_batch_size_per_gpu=32,model.gradient_checkpointing=false" \
    2>&1 | tee "$out/profile.log" | grep '^{' | cut -c1-300
  find "$out/profile" -name '*.json*' -size +20M -delete  # traces too large to bring back
  ;;
attention)  # flash (the default) against cuDNN attention: the kernels, then the update at two geometries, profiled
  [ -d /tmp/zbench-gsm8k ] || bash $gpu prep > "$out/prep.log" 2>&1
  python3 results/reference/h100-padding-20261125/varlen_probe.py 2>&1 | tee "$out/attention.log" | grep '^{'
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  z2="zero.stage=2,actor.micro_batch_size_per_gpu=32"
  timeout -s INT 420 python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
    --seqs 128 --n 4 --response-len 512 --repeats 3 --profile-dir "$out/profile" \
    --variant "z2-mb32-ckpt-sorted:$z2,model.gradient_checkpointing=true" \
    --variant "z2-mb32-ckpt-sorted-cudnn:$z2,model.gradient_checkpointing=true,model.sdpa_cudnn=true" \
    --variant "z2-mb32-sorted:$z2,model.gradient_checkpointing=false" \
    --variant "z2-mb32-sorted-cudnn:$z2,model.gradient_checkpointing=false,model.sdpa_cudnn=true" \
    2>&1 | tee "$out/update-attention.log" | grep '^{' | tee "$out/update-attention.jsonl" | cut -c1-330
  find "$out/profile" -name '*.json*' -size +20M -delete
  ;;
grpo)
  RUN_BUDGET_S=${RUN_BUDGET_S:-540} bash $gpu run grpo-six-case zero2_no_offload,zero3_no_offload 10 \
    --set rollout.backend=vllm --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32
  ;;
*)
  echo "unknown step ${1:-}: update | grpo | profile | attention" >&2; exit 2
  ;;
esac
