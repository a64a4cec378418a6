#!/usr/bin/env bash
# The kernels as they stand after review (runs longer than a tile read in sub-runs, two ranges in MAX_SPLITS
# slices) on one GPU: 128 rows at runs of 1, 4 and 16 (a 32-row tile), then the GPU-marked shared-prefix tests.
#   bash results/reference/shared-prefix-20261128/check.sh   -> $OUT/check.jsonl, check-tests.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"; here=$PWD
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu-check.txt"
(cd benchmarks && PYTHONPATH=$here timeout 60 python decode_attention_bench.py --batch 128 --width 512 --pad 337 \
  --filled 256 --share 1 4 16 --block 64 --chunk-blocks 8 --warps 4 --stages 3 --repeats 20) > "$out/check.jsonl" 2> "$out/check.err"
echo "bench rc $?"; cut -c1-400 "$out/check.jsonl"
if [ -d .pyt ]; then pip install -q --no-index --find-links .pyt pytest >/dev/null 2>&1; fi
PYTHONPATH=$here timeout 70 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -k "shared or half" \
  tests/test_rollout.py > "$out/check-tests.txt" 2>&1
echo "tests rc $?"; tail -n 3 "$out/check-tests.txt"
