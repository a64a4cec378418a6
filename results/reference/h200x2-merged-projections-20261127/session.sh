#!/usr/bin/env bash
# zbench's CUDA-graph decode loop with the replica's q/k/v and gate/up projections merged (and the Triton decode
# attention trimmed to each slice's kept positions), against the loop as before and against vLLM, on the same GSM8K
# prompts and the same host: PPO's 32 rows per GPU (32 prompts x 1) and GRPO's 128 (32 prompts x 4), 512 new tokens,
# Qwen3-0.6B shape (random weights). Meanwhile, on GPU 1, the GPU-marked tests of the loop and the kernels. From the
# project root, with the GPU machine's kits on the path and GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/h200x2-merged-projections-20261127/session.sh   -> $OUT/*.jsonl, tests.log, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
data=/tmp/zbench-gsm8k/train.parquet
[ -f $data ] || python3 -m zbench data gsm8k --src "${GSM8K_DIR:-.gsm8k}" --out /tmp/zbench-gsm8k > /dev/null || exit 1
python3 -m zbench model qwen3-0.6b > /dev/null || exit 1
python3 -m zbench env --json > "$out/env.json" 2>&1
{ lscpu; echo; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
CUDA_VISIBLE_DEVICES=1 timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -x -q -m gpu \
  tests/test_rollout.py > "$out/tests.log" 2>&1 &
tests=$!
# the attention alone: trimmed to each slice's kept positions or not, at slices of 1, 2 and 4 blocks
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/decode_attention_bench.py --batch 32 128 --block 64 \
  --chunk-blocks 1 2 4 --warps 4 --stages 3 --trim on off >> "$out/attn.jsonl" 2>> "$out/attn.err"
for rows in "32 1" "128 4"; do
  set -- $rows
  CUDA_VISIBLE_DEVICES=0 timeout "${GRAPH_TIMEOUT_S:-300}" python3 benchmarks/graph_decode_profile.py \
    --model qwen3-0.6b --data "$data" --batch "$1" --n "$2" --new-tokens 512 --repeats 5 --attention triton \
    --merge off on --top 12 2>> "$out/graph.err" >> "$out/graph.jsonl"
  grep '"generate"' "$out/graph.jsonl" | tail -n 2 | cut -c1-300
done
wait $tests; tail -n 5 "$out/tests.log"
for rows in "32 1" "32 4"; do  # vLLM's default engine, both GPUs generating at once, as in a 2-GPU case
  set -- $rows; barrier=$(mktemp -d)
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$(( $(nproc) / 2 )) timeout "${PAIR_TIMEOUT_S:-200}" \
      python3 benchmarks/vllm_profile.py --data "$data" --prompts "$1" --n "$2" --new-tokens 512 --repeats 5 \
      --variant '{"name":"default","engine":{}}' --barrier "$barrier" --parties 2 \
      2> >(tail -n 40 > "$out/vllm-$1-$2-gpu$gpu.err") >> "$out/vllm.jsonl" &
  done
  wait; rm -rf "$barrier"
  grep '"generate"' "$out/vllm.jsonl" | tail -n 2 | cut -c1-240
done
echo "done $(date -u +%FT%TZ)"
