#!/usr/bin/env bash
# PPO's critic update in turns with the actor's (serial) or beside it (concurrent), on one host with 2 NVIDIA H200s,
# at the reference config (Qwen3-0.6B shape, GSM8K prompts, 64 prompts per step over 2 ranks, 512 new tokens, bf16,
# vLLM 0.26 with the fitted KV cache, batch geometry from the GPU defaults). From the project root, with the kits of
# the GPU machine's README on the path and GSM8K's jsonl files in $GSM8K_DIR:
#   bash results/reference/h200x2-critic-20261126/session.sh ab CASES [STEPS]  # critic-update.yaml's CASES (a
#        glob), one after another in matrix order, STEPS each (default 12); the first call also runs gpu.sh prep
#   bash results/reference/h200x2-critic-20261126/session.sh profile MATRIX CASE STEPS K  # a shipped matrix's case
#        with step K profiled in every worker (its text reports under the case's profile/)
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
here=results/reference/h200x2-critic-20261126
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
bash $g prep-once || exit 1
step=${1:-}; shift || true
case $step in
ab)
  cases=$1; steps=${2:-12}; tag=${cases//[^a-z0-9]/}
  RUN_BUDGET_S=${RUN_BUDGET_S:-560} RUN_TAG=$tag bash $g run $here/critic-update.yaml "$cases" "$steps" \
    --set rollout.backend=vllm 2>&1 | tee "$out/ab-$tag.log"
  ;;
profile)
  matrix=$1; case=$2; steps=$3; k=$4
  RUN_BUDGET_S=${RUN_BUDGET_S:-400} RUN_TAG=profile bash $g run "$matrix" "$case" "$steps" --set rollout.backend=vllm \
    --set trainer.profile_step="$k" 2>&1 | tee "$out/profile-$matrix-$case.log"
  ;;
*)
  echo "unknown step $step: ab CASES [STEPS] | profile MATRIX CASE STEPS K" >&2; exit 2
  ;;
esac
