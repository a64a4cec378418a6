#!/usr/bin/env bash
# The graph loop as it now stands (shared prompt reads, 8 blocks a slice) against the tree of c3b30fe (in $BASE,
# default .base), back to back on one GPU: PPO's 32 rows (32 prompts x 1) and GRPO's 128 (32 x 4), prompts padded to
# 512 as the replica pads them. From the project root, GSM8K in data/gsm8k:
#   bash results/reference/shared-prefix-20261128/final.sh   -> $OUT/f32.jsonl, f128.jsonl, *.err
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
base=$(realpath "${BASE:-.base}"); here=$PWD
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu-final.txt"
common=(--model qwen3-0.6b --data "$here/data/gsm8k/train.parquet" --prompt-width 512 --attention triton --repeats 3
        --top 40)
run() {  # name, tree, then arguments
  local name=$1 tree=$2; shift 2
  (cd "$tree/benchmarks" && PYTHONPATH=$tree python graph_decode_profile.py "${common[@]}" "$@") \
    >> "$out/$name.jsonl" 2>> "$out/$name.err"
  echo "$name $* done $(date -u +%T)"
}
run f128 "$here" --batch 128 --n 4 --gaps
run f128 "$base" --batch 128 --n 4
run f32 "$here" --batch 32 --n 1 --gaps
run f32 "$base" --batch 32 --n 1
