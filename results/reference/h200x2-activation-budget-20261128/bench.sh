#!/usr/bin/env bash
# The actor update alone (benchmarks/actor_update.py: one rank's GRPO share, 128 sequences of GSM8K prompts x 4
# samples with 512-token responses, medians of 3 after a warm-up) with every decoder layer keeping its activations
# at several `model.activation_memory_budget`s, against every layer checkpointed: ZeRO-2 at micro-batch 32 on GPU 0;
# on GPU 1 the GPU-marked test of a tune trial's memory given back, then ZeRO-3 at micro-batch 64. Needs the kit
# (DeepSpeed) and `gpu.sh prep`. From the project root:
#   bash results/reference/h200x2-activation-budget-20261128/bench.sh  -> $OUT/update-z2.jsonl, update-z3.jsonl,
#                                                                          *.log, memory-back-tests.txt, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
common="model.head_loss_in_forward=true"
sweep() {  # GPU, name prefix, base settings, budgets...
  local gpu=$1 name=$2 base=$3; shift 3
  local variants=(--variant "$name-ck28:$base,model.gradient_checkpointing=true")
  for b in "$@"; do variants+=(--variant "$name-ck0-b$b:$base,model.activation_memory_budget=$b"); done
  CUDA_VISIBLE_DEVICES=$gpu timeout "${UPDATE_BUDGET_S:-400}" python3 benchmarks/actor_update.py --model qwen3-0.6b \
    --data /tmp/zbench-gsm8k/train.parquet --seqs 128 --n 4 --response-len 512 --repeats 3 "${variants[@]}" \
    > "$out/update-$name.log" 2>&1
  grep '^{' "$out/update-$name.log" > "$out/update-$name.jsonl"
}
sweep 0 z2 "zero.stage=2,actor.micro_batch_size_per_gpu=32,$common" ${Z2_BUDGETS:-1.0 0.5 0.3 0.15 0} &
z2=$!
if [ -z "${SKIP_TESTS:-}" ]; then
  pip install -q --no-index --find-links .pyt pytest > /dev/null 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/test_sessions.py -k gpu_memory_back > "$out/memory-back-tests.txt" 2>&1
  echo "memory-back tests rc $?"; tail -n 5 "$out/memory-back-tests.txt"
fi
sweep 1 z3 "zero.stage=3,actor.micro_batch_size_per_gpu=64,$common" ${Z3_BUDGETS:-0.3 0.15}
wait $z2
for f in "$out"/update-z2.jsonl "$out"/update-z3.jsonl; do
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print({k: d[k] for k in ("variant", "update_s_median", "mfu", "torch_peak_alloc_gb", "torch_peak_reserved_gb", "warmup_s")})
' "$f"
done
