#!/usr/bin/env bash
# The GRPO actor update alone (benchmarks/actor_update.py), at the geometries of this folder's table, on one GPU:
# one rank's share of the reference step (32 GSM8K prompts x 4 samples = 128 sequences, 512-token responses,
# Qwen3-0.6B shape, bf16, one epoch of one mini-batch), each variant on a fresh DeepSpeed engine in one process.
#   bash results/reference/h200-update-20261123/update.sh [z2|z3|all|compiled]
# Runs from the project root with zbench importable and GSM8K in $GSM8K_DIR (as results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
bash results/reference/gpu.sh prep > "$out/prep.log" 2>&1
# every variant names its layers: eager (model.compile_layers=never, the engine before compiled layers), or compiled
# where a variant adds $cl (the later setting of a key wins)
s2=zero.stage=2,model.compile_layers=never; s3=zero.stage=3,model.compile_layers=never
ck=model.gradient_checkpointing=true; plain=model.fused_head=false
mb() { echo "actor.micro_batch_size_per_gpu=$1"; }
z2=(--variant "z2-mb8-plain:$s2,$(mb 8),$plain" --variant "z2-mb8:$s2,$(mb 8)" --variant "z2-mb16:$s2,$(mb 16)"
    --variant "z2-mb32:$s2,$(mb 32)" --variant "z2-mb32-ckpt-plain:$s2,$(mb 32),$ck,$plain"
    --variant "z2-mb32-ckpt:$s2,$(mb 32),$ck" --variant "z2-mb64-ckpt:$s2,$(mb 64),$ck")
z3=(--variant "z3-mb16-plain:$s3,$(mb 16),$plain" --variant "z3-mb16:$s3,$(mb 16)"
    --variant "z3-mb32-ckpt:$s3,$(mb 32),$ck" --variant "z3-mb64-ckpt:$s3,$(mb 64),$ck")
cl=model.compile_layers=always
compiled=(--variant "z2-mb8:$s2,$(mb 8)" --variant "z2-mb16:$s2,$(mb 16)" --variant "z2-mb16-compile:$s2,$(mb 16),$cl"
          --variant "z2-mb32-ckpt:$s2,$(mb 32),$ck" --variant "z2-mb32-ckpt-compile:$s2,$(mb 32),$ck,$cl"
          --variant "z3-mb64-ckpt:$s3,$(mb 64),$ck" --variant "z3-mb64-ckpt-compile:$s3,$(mb 64),$ck,$cl")
case ${1:-all} in
z2) variants=("${z2[@]}") ;;
z3) variants=("${z3[@]}") ;;
all) variants=("${z2[@]}" "${z3[@]}") ;;
compiled) variants=("${compiled[@]}") ;;   # after the head's reductions were compiled, and with compiled layers
*) echo "unknown set ${1}: z2 | z3 | all | compiled" >&2; exit 2 ;;
esac
python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet --seqs 128 --n 4 \
  --response-len 512 --repeats 3 "${variants[@]}" 2>&1 | tee "$out/update.log" | grep '^{' | tee "$out/update.jsonl"
while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
bash results/reference/gpu.sh pack-ops > /dev/null
