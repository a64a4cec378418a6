#!/usr/bin/env bash
# Is vLLM's rollout slower inside a PPO case than alone (h200x2-vllm-levers-20261127)? The benchmark with a trainer
# rank's niceness (Ray's workers: 15) and with the trainer's sleep / weight push / wake cycle, each beside the default,
# then the serial PPO case with Ray's workers at niceness 15 and 0, each with a profiled step (torch.profiler, and
# once cProfile per phase). From the project root, with the GPU machine's kits on the path:
#   bash results/reference/h200x2-trainer-rollout-20261127/session.sh bench     -> $OUT/vllm32.jsonl, $OUT/host.txt
#   bash results/reference/h200x2-trainer-rollout-20261127/session.sh trainer   -> run roots (gpu.sh run)
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
pair=results/reference/h200x2-rollout32-20261127/session.sh
step=${1:-}; shift || true
case $step in
bench)  # each pair: the first variant on GPU 0, the second on GPU 1, both generating at once
  P='{"name":"plain","engine":{}}'
  N15='{"name":"nice15","engine":{},"nice":15}'
  CYC='{"name":"cycle","engine":{},"cycle":true}'
  export PAIR_TIMEOUT_S=${PAIR_TIMEOUT_S:-300}
  bash $pair host
  bash $pair pair "$N15" "$P"
  bash $pair pair "$P" "$N15"
  bash $pair pair "$CYC" "$P"
  ;;
trainer)  # niceness 15 (Ray's default) and 0 under torch.profiler at step 5; then 15 under cProfile at step 5
  for run in 15:torch 0:torch 15:python; do
    nice=${run%%:*}; prof=${run##*:}
    export RAY_worker_niceness=$nice
    RUN_BUDGET_S=${RUN_BUDGET_S:-200} RUN_TAG=serial-nice$nice-$prof bash results/reference/gpu.sh run six-case \
      zero1_no_offload 8 --set rollout.backend=vllm --set trainer.critic_update=serial --set trainer.profile_step=5 \
      --set trainer.profiler=$prof
  done
  ;;
*) echo "unknown step $step: bench | trainer" >&2; exit 2 ;;
esac
echo "$step done $(date -u +%FT%TZ)"
