#!/usr/bin/env bash
# The decode kernels alone, torch with Triton only. On GPU 0, the decode attention
# (benchmarks/decode_attention_bench.py, one call per layer captured as a CUDA graph and replayed): GRPO's 128 rows a
# GPU with prompts 512 wide (half the rows left-padded by 337), every row its own prompt and runs of 4, at 64, 256
# and 448 generated positions, with the prefix's and the rows' programs in a launch each or one (ONE_GRID) and
# without and with programmatic dependent launch (PDL). On GPU 1 meanwhile, the in-graph draw
# (benchmarks/race_bench.py) over its slicing and warps at PPO's 32 and GRPO's 128 rows. From the project root:
#   bash results/reference/h200x2-pdl-20261128/kernels.sh   -> $OUT/attention.jsonl, race.jsonl, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
CUDA_VISIBLE_DEVICES=1 timeout 240 python3 benchmarks/race_bench.py --rows 32 128 --programs 512 1024 2048 4096 \
  --warps 4 8 > "$out/race.jsonl" 2> "$out/race.err" &
geometry=(--batch 128 --width 512 --pad 337 --new-tokens 512 --block 64)
for filled in 64 256 448; do
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/decode_attention_bench.py "${geometry[@]}" --filled "$filled" \
    --share 1 4 --chunk-blocks 8 --warps 4 --stages 3 --one-grid off on --pdl off on
done > "$out/attention.jsonl" 2> "$out/attention.err"
wait
python3 - "$out/attention.jsonl" "$out/race.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        d = json.loads(line)
        print({k: v for k, v in d.items() if not isinstance(v, (list, dict))})
PY
tail -n 3 "$out/attention.err" "$out/race.err"
