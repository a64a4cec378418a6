#!/usr/bin/env bash
# What one prompt width a run costs the graph loop (`HFRollout.prompt_width`: with the Triton attention every batch
# is padded to data.max_prompt_length, 512 in the reference config, so the decode step is recorded once a run):
# one step's GSM8K prompts padded to the next multiple of 64 (384 here) and to 512, 32 rows (32 x 1) and 128
# (32 x 4), merged projections, 512 new tokens, Qwen3-0.6B shape. Meanwhile, on GPU 1, the GPU-marked tests of the
# loop. Needs only PyTorch, transformers and Triton (no kits); GSM8K as parquet (`zbench data gsm8k`) in $DATA:
#   DATA=data/gsm8k/train.parquet bash results/reference/h200x2-merged-projections-20261127/width.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
CUDA_VISIBLE_DEVICES=1 timeout "${TESTS_TIMEOUT_S:-280}" python3 -m pytest -x -q -m gpu tests/test_rollout.py \
  > "$out/width-tests.log" 2>&1 &
tests=$!
for rows in "32 1" "128 4"; do
  set -- $rows
  CUDA_VISIBLE_DEVICES=0 timeout "${GRAPH_TIMEOUT_S:-150}" python3 benchmarks/graph_decode_profile.py \
    --model qwen3-0.6b --data "$DATA" --batch "$1" --n "$2" --new-tokens 512 --repeats 3 --attention triton \
    --merge on --prompt-width 0 512 --top 8 2>> "$out/width.err" >> "$out/width.jsonl"
done
wait $tests; tail -n 3 "$out/width-tests.log"
echo "done $(date -u +%FT%TZ)"
