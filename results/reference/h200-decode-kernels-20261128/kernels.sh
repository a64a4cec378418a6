#!/usr/bin/env bash
# The decode attention alone (benchmarks/decode_attention_bench.py, one call per layer captured as a CUDA graph and
# replayed), GRPO's 128 rows a GPU with prompts 512 wide (half the rows left-padded by 337): a `_partial` launch a
# range and `_combine` (ONE_LAUNCH off) against one launch that merges in its last program (on), every row its own
# prompt and runs of 4, at 64, 256 and 448 generated positions, on GPU 0; on GPU 1 the one-launch path checked on
# the GPU with CHECK=results/reference/h200-decode-kernels-20261128/check_one_launch.py. Needs only torch with
# Triton, and the tree of the commit that added ONE_LAUNCH (main went back to the launches). From the project root:
#   CHECK=results/reference/h200-decode-kernels-20261128/check_one_launch.py \
#     bash results/reference/h200-decode-kernels-20261128/kernels.sh   -> $OUT/one_launch.jsonl, check.jsonl, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
if [ -n "${CHECK:-}" ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 "$CHECK" > "$out/check.jsonl" 2> "$out/check.err" &
fi
geometry=(--batch 128 --width 512 --pad 337 --new-tokens 512 --block 64)
for filled in 64 256 448; do
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/decode_attention_bench.py "${geometry[@]}" --filled "$filled" --share 1 4 \
    --chunk-blocks 8 --warps 4 --stages 3 --one-launch off on
done > "$out/one_launch.jsonl" 2> "$out/one_launch.err"
wait
python3 - "$out/one_launch.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
sdpa = [i for i, d in enumerate(rows) if d["variant"] == "sdpa"]  # one a --filled, in the loop's order
for filled, at in zip((64, 256, 448), sdpa):
    for d in rows[at + 1: at + 5]:
        print(filled, d["share"], d["one_launch"], round(d["us_per_call"], 1))
PY
cat "$out/check.jsonl" 2>/dev/null | cut -c1-400; tail -n 3 "$out/check.err" 2>/dev/null
