#!/usr/bin/env bash
# PPO's overlap on one GPU: a rollout at 32 rows in one process, a critic-sized update in another
# (benchmarks/gpu_share.py). Rounds 0-1 time the rollout alone, 2-7 both together, 8-9 the update alone.
# First time-sliced (the GPU's default between processes), then with NVIDIA MPS in front of the GPU (a private
# control daemon, stopped at the end), then MPS with the update limited to half the SMs.
#   bash results/reference/h100-gpu-share-20261127/session.sh graph   # zbench's CUDA-graph decode loop, random prompts
#   bash results/reference/h100-gpu-share-20261127/session.sh vllm    # a PPO case's vLLM engine, GSM8K prompts
#        (converted from $GSM8K_DIR's jsonl; vLLM and the kits of the GPU machine's README on the path)
#   bash results/reference/h100-gpu-share-20261127/session.sh mps-case  # a tiny PPO case on one GPU with
#        trainer.critic_sm_percent=50 (the whole path: private MPS daemon, Ray workers as its clients, shutdown);
#        the engine's output in $OUT/mps-case.log, then any MPS process left behind (there should be none)
# Appends to $OUT/share.jsonl; the processes' stderr goes to $OUT/share-ENGINE.log.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
engine=${1:-graph}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "$engine" = mps-case ]; then
  case_dir=$(mktemp -d)/mps
  python3 - "$case_dir" <<'PY'
import sys
from pathlib import Path
from zbench.config import dump_yaml, from_dict
case = Path(sys.argv[1])
case.mkdir(parents=True)
cfg = {"name": "mps", "algorithm": "ppo", "steps": 3, "seed": 11,
       "trainer": {"world_size": 1, "device": "cuda", "critic_update": "overlap", "critic_sm_percent": 50}}
(case / "config.yaml").write_text(dump_yaml(from_dict(cfg)))
PY
  timeout "${CASE_TIMEOUT_S:-600}" python3 -m zbench.engine "$case_dir" > "$out/mps-case.log" 2>&1
  echo "engine exit code $?" | tee -a "$out/mps-case.log"
  grep -h "NVIDIA MPS\|^step:" "$out/mps-case.log" | cut -c1-200
  cp "$case_dir/metrics.jsonl" "$out/mps-case-metrics.jsonl" 2>/dev/null
  cp "$case_dir/result.json" "$out/mps-case-result.json" 2>/dev/null && grep -o '"mps": {[^}]*}' "$out/mps-case-result.json"
  cp -r "$case_dir/mps" "$out/mps-case-log" 2>/dev/null
  echo "MPS processes left: $(pgrep -a nvidia-cuda-mps || echo none)" | tee -a "$out/mps-case.log"
  exit 0
fi
args=(--engine "$engine")
if [ "$engine" = vllm ]; then
  [ -f /tmp/zbench-gsm8k/train.parquet ] || python3 -m zbench data gsm8k --src "${GSM8K_DIR:-.gsm8k}" --out /tmp/zbench-gsm8k > /dev/null
  args+=(--data /tmp/zbench-gsm8k/train.parquet)
fi
pair() {  # LABEL [env for the update process...]
  local label=$1; shift
  local dir; dir=$(mktemp -d)
  # a PPO rank's worker has OMP_NUM_THREADS at half the host's cores (zbench.engine.trainer)
  OMP_NUM_THREADS=$(( $(nproc) / 2 )) timeout 200 python3 benchmarks/gpu_share.py decode "${args[@]}" \
    --barrier "$dir" --parties 2 --active 0:8 --label "$label-$engine" >> "$out/share.jsonl" 2>> "$out/share-$engine.log" &
  env "$@" timeout 200 python3 benchmarks/gpu_share.py train --barrier "$dir" --parties 2 --active 2:10 \
    --label "$label-$engine" >> "$out/share.jsonl" 2>> "$out/share-$engine.log"
  wait
  rm -rf "$dir"
}
pair timeslice
if command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/zbench-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/zbench-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started" >> "$out/share-$engine.log"
  pair mps
  pair mps-update-half-sms CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
  echo quit | nvidia-cuda-mps-control
  mkdir -p "$out/mps-log-$engine" && cp "$CUDA_MPS_LOG_DIRECTORY"/* "$out/mps-log-$engine/" 2>/dev/null
else
  echo "no nvidia-cuda-mps-control on this machine" | tee -a "$out/share-$engine.log"
fi
