#!/usr/bin/env bash
# The decode attention's kernels alone (benchmarks/decode_attention_bench.py, one call per layer captured as a CUDA
# graph and replayed), GRPO's 128 rows a GPU with prompts 512 wide (half the rows left-padded by 337): on GPU 0, the
# mask read every block (DENSE off) against the range loop (on), every row its own prompt and runs of 4, at 64, 256
# and 448 generated positions; on GPU 1, the range loop's geometry (blocks a slice, warps, pipeline stages) at 256.
# Needs only torch with Triton. From the project root:
#   bash results/reference/h200x2-dense-20261128/kernels.sh   -> $OUT/dense.jsonl, sweep.jsonl, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
geometry=(--batch 128 --width 512 --pad 337 --new-tokens 512 --block 64)
for filled in 64 256 448; do
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/decode_attention_bench.py "${geometry[@]}" --filled "$filled" --share 1 4 \
    --chunk-blocks 8 --warps 4 --stages 3 --dense off on
done > "$out/dense.jsonl" 2> "$out/dense.err" &
CUDA_VISIBLE_DEVICES=1 python3 benchmarks/decode_attention_bench.py "${geometry[@]}" --filled 256 --share 4 \
  --chunk-blocks 4 8 16 --warps 2 4 8 --stages 2 3 4 --dense on > "$out/sweep.jsonl" 2> "$out/sweep.err"
wait
# what a plain read of as many bytes reaches on this GPU (torch's sum over a bf16 tensor of 157 MB, the keys and
# values a mid-rollout call reads with runs of 4, and of 314 MB, without): the bandwidth the kernels are set against
python3 - > "$out/read.jsonl" <<'PY'
import json, torch
for mb in (157, 314):
    x = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        x.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        x.sum()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / 200
    print(json.dumps({"what": "read", "mb": mb, "us_per_read": us, "tb_per_s": mb * 2**20 / us / 1e6}))
PY
cat "$out/read.jsonl"
python3 - "$out/dense.jsonl" "$out/sweep.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    print(path)
    for line in open(path):
        d = json.loads(line)
        print({k: d.get(k) for k in ("variant", "attended", "share", "dense", "chunk_blocks", "warps", "stages",
                                     "us_per_call", "max_abs_error", "error") if k in d})
PY
