#!/usr/bin/env bash
# GRPO ZeRO-2 with the graph loop tuned within 28 GB (`zbench tune --memory-budget 28`, the speed issue's ZeRO-2
# peak) at the reference config of `gpu.sh run`, within $TUNE_S seconds (default 300); then, with `run`, the tuned
# matrix for 10 steps and its bare-DeepSpeed floors. Needs the kit and `gpu.sh prep`. From the project root:
#   bash results/reference/h200x2-dense-20261128/tune.sh tune   -> $OUT/tune.log, tune.tgz
#   bash results/reference/h200x2-dense-20261128/tune.sh run    -> $OUT/tuned.log, tuned.tgz
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tag=gpu-tune-grpo-z2
case ${1:-} in
tune)
  s=${TUNE_S:-300}
  timeout -s INT -k 30 $(( s + 90 )) python3 -m zbench tune results/reference/released-cache-20261128/grpo.yaml \
    --cases zero2_graph --memory-budget 28 --time-budget "$s" --seed 7777 --results-dir /tmp/zbench-results \
    --tag "$tag" --set model.path=qwen3-0.6b --set trainer.world_size=2 \
    --set data.train_files=/tmp/zbench-gsm8k/train.parquet --set data.max_prompt_length=512 \
    --set trainer.train_batch_size=64 --set actor.ppo_mini_batch_size=64 --set rollout.max_new_tokens=512 \
    --set actor.lr=1e-6 --set critic.lr=1e-5 > "$out/tune.log" 2>&1
  echo "tune rc $?"; grep '^\[tune\]\|^trials\|^tuned\|stopped' "$out/tune.log" | tail -n 30
  root=$(ls -d /tmp/zbench-results/"$tag"_* | tail -n 1)
  tar -czf "$out/tune.tgz" -C "$(dirname "$root")" "$(basename "$root")"
  ;;
run)
  root=$(ls -d /tmp/zbench-results/"$tag"_* | tail -n 1)
  timeout -s INT -k 30 "${RUN_S:-200}" python3 -m zbench run "$root/tuned.yaml" --steps 10 --seed 7777 \
    --results-dir /tmp/zbench-results --tag gpu-tuned-grpo-z2 --retries 0 > "$out/tuned.log" 2>&1
  echo "run rc $?"; tail -n 14 "$out/tuned.log"
  run=$(ls -d /tmp/zbench-results/gpu-tuned-grpo-z2_* | tail -n 1)
  timeout -s INT -k 30 "${FLOOR_S:-150}" python3 -m zbench bench floor --like "$run" --warmup 1 --steps 4 \
    | grep '^{' | cut -c1-300
  tar --exclude=ckpt --exclude='*.json.gz' -czf "$out/tuned.tgz" -C "$(dirname "$run")" "$(basename "$run")"
  ;;
*) echo "tune.sh tune | run" >&2; exit 2 ;;
esac
