#!/usr/bin/env bash
# The graph loop alone at GRPO's 128 rows (32 GSM8K prompts x 4 samples, padded to 512 as the replica pads them),
# its decode step compiled with reduce-overhead, then with max-autotune, on GPU 1; meanwhile the GPU-marked tests of
# the loop over released memory on GPU 0 (released-cache-20261128/check.sh). From the project root, with
# data/gsm8k/train.parquet (`zbench data gsm8k`):
#   bash results/reference/h200x2-final-20261128/bench.sh   -> $OUT/autotune.jsonl, bench.log, host.txt, check.log,
#                                                              check-tests.txt, gpu-check.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
CUDA_VISIBLE_DEVICES=0 OUT=$out bash results/reference/released-cache-20261128/check.sh > "$out/check.log" 2>&1 &
tests=$!
CUDA_VISIBLE_DEVICES=1 timeout "${BENCH_S:-400}" python benchmarks/graph_decode_profile.py --model qwen3-0.6b \
  --batch 128 --n 4 --data data/gsm8k/train.parquet --prompt-width 512 --attention triton --repeats 5 \
  --compile-mode ${MODES:-reduce-overhead max-autotune} > "$out/autotune.jsonl" 2> "$out/bench.log"
echo "bench rc $?"
wait $tests; cat "$out/check.log"
python - "$out/autotune.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    keep = {k: d[k] for k in ("compile_mode", "what", "first_s", "median_s", "min_s", "max_s", "kernel_s", "gpu_busy",
                              "max_memory_reserved_gb") if k in d}
    print(keep)
    for t in d.get("top", [])[:14]:
        print("   ", t)
PY
