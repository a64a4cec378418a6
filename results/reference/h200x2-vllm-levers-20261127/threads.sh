#!/usr/bin/env bash
# Does the OpenMP thread count of the process that hosts vLLM (a PPO rank's worker runs with half the host's cores,
# zbench.engine.trainer) make the rollout's host loop slower or less steady? The default in-process engine at 32
# sequences per GPU on both GPUs at once, as in session.sh's pairs, with both processes at the same
# OMP_NUM_THREADS: 16, 1, 16, 1 (alternating, so that drift over the minutes shows).
#   bash results/reference/h200x2-vllm-levers-20261127/threads.sh     -> $OUT/threads.jsonl
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
for threads in 16 1 16 1; do
  barrier=$(mktemp -d)
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$threads timeout 300 \
      python3 benchmarks/vllm_profile.py --data /tmp/zbench-gsm8k/train.parquet --prompts 32 --n 1 \
      --new-tokens 512 --repeats 8 --variant "{\"name\":\"omp$threads\",\"engine\":{}}" --barrier "$barrier" \
      --parties 2 2> >(tail -n 20 > "$out/threads-gpu$gpu.err") >> "$out/threads.jsonl" &
  done
  wait
  rm -rf "$barrier"
done
echo "threads done $(date -u +%FT%TZ)"
