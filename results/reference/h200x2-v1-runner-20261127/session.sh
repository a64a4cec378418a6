#!/usr/bin/env bash
# vLLM's V1 model runner against its V2 runner (vLLM 0.26's default for Qwen3), at PPO's and GRPO's rows per GPU;
# then PPO ZeRO-1 and ZeRO-2 at the defaults with step 3 under torch.profiler (its next step shows whether the
# profile's garbage is still paid there); then the tests marked for vLLM and the GPU, alone on the machine.
# From the project root, with the GPU machine's kits on the path:
#   bash results/reference/h200x2-v1-runner-20261127/session.sh bench           -> $OUT/vllm.jsonl, $OUT/host.txt
#   bash results/reference/h200x2-v1-runner-20261127/session.sh ppo             -> a run root (gpu.sh run)
#   bash results/reference/h200x2-v1-runner-20261127/session.sh tests           -> $OUT/tests.log
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
g=results/reference/gpu.sh
bash $g prep-once || exit 1
V2='{"name":"v2","engine":{}}'
V1='{"name":"v1","engine":{},"env":{"VLLM_USE_V2_MODEL_RUNNER":"0"}}'
pair() {  # PROMPTS N A B: variant A on GPU 0 and B on GPU 1, generating at the same time
  local prompts=$1 n=$2 barrier; barrier=$(mktemp -d)
  for gpu in 0 1; do
    variant=$3; [ "$gpu" = 1 ] && variant=$4
    # a rank's worker has OMP_NUM_THREADS at half the host's cores (zbench.engine.trainer)
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$(( $(nproc) / 2 )) timeout "${PAIR_TIMEOUT_S:-300}" \
      python3 benchmarks/vllm_profile.py --data /tmp/zbench-gsm8k/train.parquet --prompts "$prompts" --n "$n" \
      --new-tokens 512 --repeats 5 --variant "$variant" --barrier "$barrier" --parties 2 \
      2> >(tail -n 40 > "$out/vllm-$prompts-$n-gpu$gpu.err") >> "$out/vllm.jsonl" &
  done
  wait
  rm -rf "$barrier"
  grep '"generate"' "$out/vllm.jsonl" | tail -n 2 | cut -c1-240
}
step=${1:-}; shift || true
case $step in
bench)  # PPO's 32 rows per GPU, then GRPO's 32 prompts x 4 samples; each runner once on each GPU
  { lscpu; echo; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
  pair 32 1 "$V2" "$V1"
  pair 32 1 "$V1" "$V2"
  pair 32 4 "$V2" "$V1"
  pair 32 4 "$V1" "$V2"
  ;;
ppo)  # PPO ZeRO-1 and ZeRO-2 at the GPU defaults (vLLM's default runner), 10 steps, step 3 under torch.profiler
  RUN_BUDGET_S=${RUN_BUDGET_S:-420} RUN_TAG=prof3 bash $g run six-case zero1_no_offload,zero2_no_offload 10 \
    --set rollout.backend=vllm --set trainer.profile_step=3
  ;;
tests)
  timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -x -q -m "vllm or gpu" tests/test_vllm_rollout.py 2>&1 \
    | tail -n 60 | tee "$out/tests.log"
  ;;
*) echo "unknown step $step: bench | ppo | tests" >&2; exit 2 ;;
esac
echo "$step done $(date -u +%FT%TZ)"
