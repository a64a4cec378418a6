#!/usr/bin/env bash
# PPO's critic update beside the rollout through NVIDIA MPS (`trainer.critic_sm_percent`), on a 2 x H200 host, all
# in one background process (started with setsid, so it outlives the call that starts it; later calls collect):
#   setsid nohup bash results/reference/h200x2-mps-20261127/session.sh DEADLINE > /tmp/mps-out/driver.log 2>&1 &
# DEADLINE is the epoch second by which the run must be closed and packed. Steps, each into /tmp/mps-out:
#   1. the vLLM kit (/tmp/bund/setup.sh, the GPU machine's README) and `gpu.sh prep-once`;
#   2. a tiny PPO case on one GPU with critic_sm_percent=50 (`../h100-gpu-share-20261127/session.sh mps-case`);
#   3. the reference config's PPO ZeRO-1 and ZeRO-2, time-sliced and through MPS (ppo-critic-mps.yaml), 10 steps.
set -uo pipefail
deadline=$1
here=$(dirname "$0")
export OUT=/tmp/mps-out
mkdir -p "$OUT"
source /tmp/bund/setup.sh > "$OUT/setup.log" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
echo "prepared at $(date +%T)"
CASE_TIMEOUT_S=170 bash results/reference/h100-gpu-share-20261127/session.sh mps-case
echo "mps-case done at $(date +%T)"
FRONTIER_MATRIX=$here/ppo-critic-mps.yaml RUN_UNTIL=$deadline RUN_BUDGET_S=1400 \
  bash results/reference/h200x2-ckpt-20261126/session.sh frontier \
  'zero1_slices,zero1_mps50,zero2_slices,zero2_mps50,zero1_mps30' 10
echo "MPS processes left: $(pgrep -a nvidia-cuda-mps || echo none)"
echo "finished at $(date +%T)"
touch "$OUT/DONE"
