#!/usr/bin/env bash
# vLLM's rollout at PPO's share of the reference config (32 sequences per GPU, GSM8K prompts, 512 new tokens, the
# fitted KV cache), measured on both GPUs of one host at once, as a PPO case's two ranks generate, beside the same
# rollout inside a PPO case on the same host.
# From the project root, with the kits of the GPU machine's README on the path and GSM8K's jsonl in $GSM8K_DIR:
#   bash results/reference/h200x2-rollout32-20261127/session.sh host        # this host's CPU and GPU clocks
#   bash results/reference/h200x2-rollout32-20261127/session.sh pair A B    # benchmarks/vllm_profile.py, variant
#        A on GPU 0 and B on GPU 1 at the same time (each a JSON object, see the benchmark) -> $OUT/vllm32.jsonl
#   bash results/reference/h200x2-rollout32-20261127/session.sh ref MATRIX CASES [STEPS]  # as h200x2-ckpt-20261126
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
bash $g prep-once || exit 1
step=${1:-}; shift || true
case $step in
host)
  { lscpu; echo; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
  grep -m1 'Model name' "$out/host.txt"
  ;;
pair)
  barrier=$(mktemp -d)
  for gpu in 0 1; do
    variant=$1; [ "$gpu" = 1 ] && variant=$2
    # a PPO rank's worker has OMP_NUM_THREADS at half the host's cores (zbench.engine.trainer)
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$(( $(nproc) / 2 )) timeout "${PAIR_TIMEOUT_S:-240}" \
      python3 benchmarks/vllm_profile.py --data /tmp/zbench-gsm8k/train.parquet --prompts 32 --n 1 \
      --new-tokens 512 --repeats 5 --variant "$variant" --barrier "$barrier" --parties 2 \
      2> >(tail -n 40 > "$out/vllm32-gpu$gpu.err") >> "$out/vllm32.jsonl" &
  done
  wait
  rm -rf "$barrier"
  grep '"generate"\|"profile"' "$out/vllm32.jsonl" | tail -n 6 | cut -c1-300
  ;;
ref)
  bash results/reference/h200x2-ckpt-20261126/session.sh ref "$@"
  ;;
*)
  echo "unknown step $step: host | pair A B | ref MATRIX CASES [STEPS]" >&2; exit 2
  ;;
esac
