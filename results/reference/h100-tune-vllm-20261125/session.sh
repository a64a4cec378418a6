#!/usr/bin/env bash
# The runs of this folder, on one GPU: the 1-GPU proxy of the reference config (Qwen3-0.6B shape, GSM8K prompts,
# 512 new tokens, vLLM with the fitted KV cache; 32 prompts per step, one rank's share of the 2-GPU reference).
# From the project root, with the kits of the GPU machine's README on the path:
#   bash results/reference/h100-tune-vllm-20261125/session.sh tune MATRIX CASES  # prep, then `zbench tune` of the
#        cases within $TUNE_BUDGET_S (default 460), then their tuned matrix for $TUNED_STEPS steps (default 10)
#   bash results/reference/h100-tune-vllm-20261125/session.sh tuned MATRIX       # the last tune's tuned.yaml, 10 steps
#   bash results/reference/h100-tune-vllm-20261125/session.sh vllm VARIANT_JSON...  # benchmarks/vllm_profile.py
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
proxy=(--set trainer.train_batch_size=32 --set actor.ppo_mini_batch_size=32)
case ${1:-} in
tune)
  bash $g prep > "$out/prep.log" 2>&1
  TUNE_BUDGET_S=${TUNE_BUDGET_S:-460} bash $g tune "$2" "$3" "${proxy[@]}" 2>&1 | tee "$out/tune-$2.log"
  ;;
tuned)
  root=$(ls -d /tmp/zbench-results/gpu-tune-"$2"_* | tail -n 1)
  timeout -s INT -k 30 "${RUN_BUDGET_S:-540}" python3 -m zbench run "$root/tuned.yaml" --steps 10 --seed 7777 \
    --results-dir /tmp/zbench-results --tag "gpu-tuned-$2" --retries 0 2>&1 | tail -n 25 | tee "$out/tuned-$2.log"
  run=$(ls -d /tmp/zbench-results/gpu-tuned-"$2"_* | tail -n 1)
  tar --exclude=ckpt -czf "$out/run-tuned-$2.tgz" -C "$(dirname "$run")" "$(basename "$run")"
  ;;
vllm)  # after `tune` (its prep wrote the GSM8K parquet)
  shift
  for variant in "$@"; do
    timeout 280 python3 benchmarks/vllm_profile.py --data /tmp/zbench-gsm8k/train.parquet --prompts 32 --n 4 \
      --new-tokens 512 --repeats 3 --variant "$variant" 2> >(tail -n 40 >> "$out/vllm_profile.err") \
      | tee -a "$out/vllm_profile.jsonl" | cut -c1-400
  done
  ;;
*)
  echo "unknown step ${1:-}: tune | tuned | vllm" >&2; exit 2
  ;;
esac
