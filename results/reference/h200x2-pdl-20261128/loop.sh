#!/usr/bin/env bash
# The graph loop alone at GRPO's 128 rows (benchmarks/graph_decode_profile.py: one step's 32 GSM8K prompts x 4
# samples padded to 512, 512 tokens, the Qwen3-0.6B shape with random weights, 5 timed rollouts after the compile,
# one profiled), each variant on a fresh copy of the model, on GPU 0. Needs the kit and `gpu.sh prep`.
#   VARIANTS="--one-grid off on --pdl off on" bash results/reference/h200x2-pdl-20261128/loop.sh   -> loop.jsonl
#     (the first machine, the tree of 88f90ed, where both switches were off by default)
#   VARIANTS="--one-grid on --pdl on off" TAG=-defaults bash results/reference/h200x2-pdl-20261128/loop.sh
#     (the second machine, the tree of 96c440d, both on by default; GPU 1 ran the GPU-marked tests meanwhile:
#      python3 -m pytest -m gpu tests/test_rollout.py tests/test_race_sampling.py -> check-tests.txt)
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# shellcheck disable=SC2086  # VARIANTS is a list of arguments
CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/graph_decode_profile.py --model qwen3-0.6b --batch 128 --n 4 \
  --data /tmp/zbench-gsm8k/train.parquet --prompt-width 512 --attention triton --repeats 5 ${VARIANTS} --top 40 --gaps \
  > "$out/loop${TAG:-}.jsonl" 2> "$out/loop${TAG:-}.log"
python3 - "$out/loop${TAG:-}.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print({k: d[k] for k in ("one_grid", "pdl", "what", "first_s", "median_s", "min_s", "max_s", "wall_s", "kernel_s",
                             "gpu_busy") if k in d})
PY
