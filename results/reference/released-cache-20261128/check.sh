#!/usr/bin/env bash
# The GPU-marked tests of memory given back at fixed addresses and of the graph loop over it, on one GPU.
#   bash results/reference/released-cache-20261128/check.sh   -> $OUT/check-tests.txt, gpu-check.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"; here=$PWD
export HF_HUB_OFFLINE=1
nvidia-smi > "$out/gpu-check.txt" 2>&1
if [ -d .pyt ]; then pip install -q --no-index --find-links .pyt pytest >/dev/null 2>&1; fi
PYTHONPATH=$here timeout 300 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
  tests/test_device_memory.py tests/test_rollout.py > "$out/check-tests.txt" 2>&1
echo "tests rc $?"; tail -n 25 "$out/check-tests.txt"
