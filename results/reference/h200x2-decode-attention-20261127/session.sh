#!/usr/bin/env bash
# zbench's CUDA-graph decode loop with SDPA over the whole static cache and with the Triton decode attention
# (zbench.engine.decode_attention), against vLLM's rollout, on the same GSM8K prompts and the same host: PPO's 32 rows
# per GPU (32 prompts x 1) and GRPO's 128 (32 prompts x 4), 512 new tokens, Qwen3-0.6B shape (random weights).
# Meanwhile, on GPU 1, the GPU test of vLLM's weight push after a level-2 sleep. From the project root, with the GPU
# machine's kits on the path:
#   bash results/reference/h200x2-decode-attention-20261127/session.sh   -> $OUT/graph.jsonl, vllm.jsonl, tests.log
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
data=/tmp/zbench-gsm8k/train.parquet
[ -f $data ] || python3 -m zbench data gsm8k --src "${GSM8K_DIR:-.gsm8k}" --out /tmp/zbench-gsm8k > /dev/null || exit 1
python3 -m zbench model qwen3-0.6b > /dev/null || exit 1
python3 -m zbench env --json > "$out/env.json" 2>&1
{ lscpu; echo; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
CUDA_VISIBLE_DEVICES=1 timeout "${TESTS_TIMEOUT_S:-400}" python3 -m pytest -x -q -m vllm \
  tests/test_vllm_rollout.py::test_log_probs_change_no_token > "$out/tests.log" 2>&1 &
tests=$!
for rows in "32 1" "128 4"; do
  set -- $rows
  CUDA_VISIBLE_DEVICES=0 timeout "${GRAPH_TIMEOUT_S:-240}" python3 benchmarks/graph_decode_profile.py \
    --model qwen3-0.6b --data "$data" --batch "$1" --n "$2" --new-tokens 512 --repeats 5 --attention triton sdpa \
    --top 10 2>> "$out/graph.err" >> "$out/graph.jsonl"
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
