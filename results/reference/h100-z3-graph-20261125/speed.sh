#!/usr/bin/env bash
# ZeRO-3's compiled decoder layers as one graph (the guards on DeepSpeed's parameter numbers dropped), on one GPU:
# a 1-GPU proxy of the 2-GPU reference config (32 prompts per step x 4 samples = 128 sequences, one rank's share):
#   bash results/reference/h100-z3-graph-20261125/speed.sh all
# prep; the GPU tests of the compiled paths; the actor update alone at ZeRO-3 eager / compiled and ZeRO-2 compiled
# (benchmarks/actor_update.py, each variant on a fresh engine in one process); then whole GRPO ZeRO-3 steps at the
# GPU defaults. Each log is searched for Dynamo's recompile-limit warning (layers past the limit run eager).
# Runs from the project root with zbench and vLLM importable and GSM8K in $GSM8K_DIR (as results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
gpu=results/reference/gpu.sh
proxy=(--set rollout.backend=vllm --set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
case ${1:-} in
all)
  bash $gpu prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compile_layers.py 2>&1 | tail -n 5 \
    | tee "$out/pytest-gpu.txt"
  s2=zero.stage=2; s3=zero.stage=3; ck=model.gradient_checkpointing=true
  never=model.compile_layers=never; always=model.compile_layers=always
  mb() { echo "actor.micro_batch_size_per_gpu=$1"; }
  timeout -s INT 240 python3 benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
    --seqs 128 --n 4 --response-len 512 --repeats 3 \
    --variant "z3-mb64-ckpt-compiled:$s3,$(mb 64),$ck,$always" \
    --variant "z3-mb64-ckpt-eager:$s3,$(mb 64),$ck,$never" \
    --variant "z2-mb32-ckpt-compiled:$s2,$(mb 32),$ck,$always" \
    2>&1 | tee "$out/update.log" | grep '^{' | tee "$out/update.jsonl"
  echo "update.log recompile-limit warnings: $(grep -c 'hit config.recompile_limit' "$out/update.log")"
  RUN_BUDGET_S=${Z3_BUDGET_S:-270} RUN_TAG=z3 bash $gpu run grpo-six-case zero3_no_offload 10 "${proxy[@]}"
  echo "z3 train.log recompile-limit warnings: $(tar -xzOf "$out"/run-gpu-grpo-six-case-z3.tgz --wildcards \
    '*/train.log' | grep -c 'hit config.recompile_limit')"
  ;;
*)
  echo "unknown step ${1:-}: all" >&2; exit 2
  ;;
esac
