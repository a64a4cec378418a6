#!/usr/bin/env bash
# Run a matrix at the reference GPU config (Qwen3-0.6B shape, GSM8K prompts, 64 prompts, 512 new tokens) and
# measure the bare-DeepSpeed floor for each ZeRO stage in the same call. Results are packed into $OUT (or ./out).
#   bash results/reference/gpu_run.sh MATRIX CASES STEPS [extra zbench run args...]
# e.g. bash results/reference/gpu_run.sh six-case zero2_no_offload,zero3_no_offload 4
# Needs GSM8K jsonl in $GSM8K_DIR (default .gsm8k/) and zbench importable (pip install -e ., or a kit on PYTHONPATH).
set -uo pipefail
matrix=$1; cases=$2; steps=$3; shift 3
out=${OUT:-out}; mkdir -p "$out"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m zbench env --json > "$out/env.json" 2>&1
python3 -m zbench data gsm8k --src "${GSM8K_DIR:-.gsm8k}" --out /tmp/zbench-gsm8k > /dev/null || exit 1
python3 -m zbench model qwen3-0.6b
python3 -m zbench run "$matrix" --cases "$cases" --steps "$steps" --seed 7777 --results-dir /tmp/zbench-results \
  --tag "gpu-$matrix" --retries 0 --step-timeout 400 \
  --set model.path=qwen3-0.6b --set trainer.world_size="$ngpu" \
  --set data.train_files=/tmp/zbench-gsm8k/train.parquet --set data.max_prompt_length=512 \
  --set trainer.train_batch_size=64 --set actor.ppo_mini_batch_size=64 --set rollout.max_new_tokens=512 \
  --set actor.micro_batch_size_per_gpu=8 --set critic.micro_batch_size_per_gpu=8 --set actor.lr=1e-6 \
  --set critic.lr=1e-5 "$@" 2>&1 | tail -n 40
root=$(ls -d /tmp/zbench-results/gpu-"$matrix"_* | tail -n 1)
tar --exclude=ckpt -czf "$out/run-$matrix.tgz" -C "$(dirname "$root")" "$(basename "$root")"
cat "$root/summary.tsv"
