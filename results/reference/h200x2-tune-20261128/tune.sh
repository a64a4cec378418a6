#!/usr/bin/env bash
# GRPO with the graph loop tuned within a memory budget (`zbench tune`) at the reference config of `gpu.sh run`:
# the case and the budget as arguments, within $TUNE_S seconds (default 300). Needs the kit and `gpu.sh prep`. From
# the project root:
#   bash results/reference/h200x2-tune-20261128/tune.sh zero2_graph 28   -> $OUT/tune-zero2_graph.log, .tgz
#   bash results/reference/h200x2-tune-20261128/tune.sh zero3_graph 42
# $TAG names the run root (default gpu-tune-grpo-<case>).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case=${1:?case}; memory=${2:?memory budget in GB}; s=${TUNE_S:-300}; tag=${TAG:-gpu-tune-grpo-$case}
timeout -s INT -k 30 $(( s + 90 )) python3 -m zbench tune results/reference/released-cache-20261128/grpo.yaml \
  --cases "$case" --memory-budget "$memory" --time-budget "$s" --seed 7777 --results-dir /tmp/zbench-results \
  --tag "$tag" --set model.path=qwen3-0.6b --set trainer.world_size=2 \
  --set data.train_files=/tmp/zbench-gsm8k/train.parquet --set data.max_prompt_length=512 \
  --set trainer.train_batch_size=64 --set actor.ppo_mini_batch_size=64 --set rollout.max_new_tokens=512 \
  --set actor.lr=1e-6 --set critic.lr=1e-5 > "$out/tune-$case.log" 2>&1
echo "tune rc $?"; grep '^\[tune\]' "$out/tune-$case.log" | tail -n 20
root=$(ls -d /tmp/zbench-results/"$tag"_* | tail -n 1)
tar -czf "$out/tune-$case.tgz" -C "$(dirname "$root")" "$(basename "$root")"
