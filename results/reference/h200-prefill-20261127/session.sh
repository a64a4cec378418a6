#!/usr/bin/env bash
# The graph loop before and after the distinct-prompt prefill and the in-graph draw, on one GPU, same prompts:
# the tree of e354ef1 (in $BASE, default .base: `git archive e354ef1 zbench benchmarks | tar -x -C .base`) against
# this tree with the eager draw and with the draw inside the recorded step; 32 rows (PPO's 32 prompts x 1) and 128
# (GRPO's 32 x 4), prompts padded to 512 as the replica pads them. From the project root, GSM8K in data/gsm8k:
#   bash results/reference/h200-prefill-20261127/session.sh   -> $OUT/*.jsonl, *.err, gpu.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
base=$(realpath "${BASE:-.base}"); here=$PWD
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
common=(--model qwen3-0.6b --data "$here/data/gsm8k/train.parquet" --prompt-width 512 --attention triton --repeats 3 --top 40)
run() {  # name, tree, then arguments
  local name=$1 tree=$2; shift 2
  (cd "$tree/benchmarks" && PYTHONPATH=$tree python graph_decode_profile.py "${common[@]}" "$@") \
    >> "$out/$name.jsonl" 2>> "$out/$name.err"
  echo "$name $* done $(date -u +%T)"; tail -n 2 "$out/$name.jsonl" | cut -c1-330
}
run r32 "$base" --batch 32 --n 1
run r32 "$here" --batch 32 --n 1 --sampler graph eager --gaps
run r128 "$base" --batch 128 --n 4
run r128 "$here" --batch 128 --n 4 --sampler graph --gaps
