#!/usr/bin/env bash
# The attention kernels alone at GRPO's and PPO's geometry (prompts of 512 columns, 175 attended: GSM8K's mean; 256
# tokens into the response), over kernel geometries and the two ways of loading keys and values; then the tests
# marked gpu of the decode loop. `--loads` was a kernel flag and bench option of the tree this ran (keys and values
# loaded by the mask or by the range); the range lost everywhere and both were removed after it (NOTES.md, §2).
# From the project root:
#   bash results/reference/shared-prefix-20261128/sweep.sh   -> $OUT/sweep.jsonl, gpu-tests.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"; here=$PWD
export HF_HUB_OFFLINE=1
(cd benchmarks && PYTHONPATH=$here python decode_attention_bench.py --batch 128 --width 512 --pad 337 --filled 256 \
  --share 1 4 --block 32 64 --chunk-blocks 4 8 --warps 4 --stages 2 3 4 --loads mask range) > "$out/sweep.jsonl" 2> "$out/sweep.err"
(cd benchmarks && PYTHONPATH=$here python decode_attention_bench.py --batch 32 --width 512 --pad 337 --filled 256 \
  --share 1 --block 32 64 --chunk-blocks 4 8 --warps 4 --stages 2 3 4 --loads mask range) >> "$out/sweep.jsonl" 2>> "$out/sweep.err"
echo "sweep done $(date -u +%T)"
if [ -d .pyt ]; then pip install -q --no-index --find-links .pyt pytest >/dev/null 2>&1; fi  # where the host has none
PYTHONPATH=$here timeout 300 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
  tests/test_rollout.py tests/test_race_sampling.py > "$out/gpu-tests.txt" 2>&1
echo "gpu tests rc $? $(date -u +%T)"; tail -n 5 "$out/gpu-tests.txt"
