#!/usr/bin/env bash
# The graph loop alone at GRPO's 128 rows (benchmarks/graph_decode_profile.py: one step's 32 GSM8K prompts x 4
# samples padded to 512, 512 tokens, 5 timed rollouts after the compile, one profiled), the Triton attention with
# DENSE off and on, on GPU 0; meanwhile on GPU 1 the GPU-marked tests of the recorded loop and its in-graph
# draw. Needs the kit and `gpu.sh prep`. From the project root:
#   bash results/reference/h200x2-dense-20261128/loop.sh   -> $OUT/loop.jsonl, loop.log, check-tests.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(
  pip install -q --no-index --find-links .pyt pytest > /dev/null 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/test_rollout.py tests/test_race_sampling.py > "$out/check-tests.txt" 2>&1
  echo "tests rc $?" >> "$out/check-tests.txt"
) &
tests=$!
CUDA_VISIBLE_DEVICES=0 timeout "${LOOP_S:-300}" python3 benchmarks/graph_decode_profile.py --model qwen3-0.6b \
  --batch 128 --n 4 --data /tmp/zbench-gsm8k/train.parquet --prompt-width 512 --attention triton --repeats 5 \
  --dense off on > "$out/loop.jsonl" 2> "$out/loop.log"
echo "loop rc $?"
wait $tests; tail -n 4 "$out/check-tests.txt"
python3 - "$out/loop.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print({k: d[k] for k in ("dense", "what", "first_s", "median_s", "min_s", "max_s", "kernel_s", "gpu_busy",
                             "max_memory_reserved_gb") if k in d})
    for t in d.get("top", [])[:8]:
        print("   ", t)
PY
