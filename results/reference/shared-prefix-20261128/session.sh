#!/usr/bin/env bash
# GRPO's 128 rows (32 prompts x 4 samples) in the graph loop on one GPU, each prompt's part of the cache read once
# for its 4 samples against once a row, and the tree before the change (c3b30fe, in $BASE, default .base:
# `git archive c3b30fe zbench benchmarks | tar -x -C .base`); then the attention kernels alone at the same geometry.
# From the project root, GSM8K in data/gsm8k (`zbench data gsm8k`):
#   bash results/reference/shared-prefix-20261128/session.sh   -> $OUT/*.jsonl, *.err, gpu.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
base=$(realpath "${BASE:-.base}"); here=$PWD
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.txt"
common=(--model qwen3-0.6b --data "$here/data/gsm8k/train.parquet" --prompt-width 512 --attention triton --repeats 3
        --top 40 --batch 128 --n 4)
run() {  # name, tree, then arguments
  local name=$1 tree=$2; shift 2
  (cd "$tree/benchmarks" && PYTHONPATH=$tree python graph_decode_profile.py "${common[@]}" "$@") \
    >> "$out/$name.jsonl" 2>> "$out/$name.err"
  echo "$name $* done $(date -u +%T)"; tail -n 2 "$out/$name.jsonl" | cut -c1-330
}
run r128 "$base"
run r128 "$here" --share off on
# the kernels alone: prompts of 512 columns of which 175 attended (GSM8K's mean), 256 tokens into the response
(cd benchmarks && PYTHONPATH=$here python decode_attention_bench.py --batch 128 --width 512 --pad 337 --filled 256 \
  --share 1 4 --block 64 --chunk-blocks 2 4 8 --warps 4 8 --stages 2 3) > "$out/kernels.jsonl" 2> "$out/kernels.err"
echo "kernels done $(date -u +%T)"
