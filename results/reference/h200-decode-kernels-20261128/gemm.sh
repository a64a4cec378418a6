#!/usr/bin/env bash
# The decode step's four layer multiplies alone at GRPO's 128 rows a GPU (benchmarks/decode_gemm_bench.py, 28 calls
# captured as a CUDA graph and replayed): cuBLAS against the Triton kernel for few rows over 216 geometries (column
# tile 16-128, K block 64-256, K split 1-4, 3-5 stages, 4 or 8 warps). Needs only torch with Triton. From the
# project root:
#   bash results/reference/h200-decode-kernels-20261128/gemm.sh   -> $OUT/gemm.jsonl
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 benchmarks/decode_gemm_bench.py --rows 128 --block-n 16 32 64 128 --block-k 64 128 256 --split-k 1 2 4 \
  --stages 3 4 5 --warps 4 8 > "$out/gemm.jsonl" 2> "$out/gemm.err"
python3 - "$out/gemm.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for shape in ("qkv", "o", "gate_up", "down"):
    cublas = next(r for r in rows if r["shape"] == shape and r["variant"] == "cublas")
    best = min((r for r in rows if r["shape"] == shape and "us_per_call" in r and r["variant"] == "triton"),
               key=lambda r: r["us_per_call"])
    print(shape, "cublas", round(cublas["us_per_call"], 2), "triton best", round(best["us_per_call"], 2),
          {k: best[k] for k in ("block_n", "block_k", "split_k", "stages", "warps")})
PY
