#!/usr/bin/env bash
# Steps of a reference GPU run, each packing what it produces into $OUT (or ./out):
#   bash results/reference/gpu.sh prep                      # env.json, GSM8K parquet, the qwen3-0.6b preset, DeepSpeed ops
#   bash results/reference/gpu.sh gen [DECODE...]           # generation bench, one JSON line per decode mode
#   bash results/reference/gpu.sh floor "STAGES" "OFFLOADS" SEQS SEQ_LEN  # bare-DeepSpeed floors on all GPUs
#        ($FLOOR_HEADS: "lm", "value" or "lm value", default lm; $FLOOR_MICRO: micro-batch, default 8)
#   bash results/reference/gpu.sh run MATRIX CASES STEPS [zbench run args...]
#   bash results/reference/gpu.sh tune MATRIX CASES [zbench tune args...]  # each case at its best geometry, then
#        the tuned matrix run for $TUNED_STEPS steps (default 10), both at the reference config, both packed
#   bash results/reference/gpu.sh update NAME:KEY=VALUE,...  # the actor update alone, 1-GPU proxy (128 x 512
#        tokens), one variant per argument, medians of 3, within $UPDATE_BUDGET_S (default 420)
#        -> $OUT/update${UPDATE_TAG}.jsonl; with UPDATE_PROFILE="torch python" (or one of them) each variant's
#        profiled updates too -> $OUT/update-profiles${UPDATE_TAG}.tgz (text reports)
#   bash results/reference/gpu.sh tests [PYTEST ARGS...]      # the GPU-marked tests of the decode loop (test_rollout,
#        test_race_sampling; pytest from the wheels in .pyt/) on the last GPU, so that with 2 GPUs or more `loop`
#        can take GPU 0 meanwhile -> $OUT/check-tests.txt, whole, with each failure's assertion; exits as pytest did
#   bash results/reference/gpu.sh pack-ops                  # DeepSpeed's compiled ops -> $OUT/dsops.tgz
#   bash results/reference/gpu.sh loop [VARIANT ARGS...]      # the graph loop alone at GRPO's 128 rows a GPU (one
#        step's GSM8K prompts x 4 samples, 512 wide, 512 tokens; benchmarks/graph_decode_profile.py, 5 timed rollouts
#        and one profiled) on GPU 0, e.g. `--steps-per-graph 1 8` -> $OUT/loop${LOOP_TAG}.jsonl
#   bash results/reference/gpu.sh prep-once                 # prep (log in $OUT/prep.log) unless this machine has
#        it already, then wait for the ops to compile: the first step of a session's every call
# `prep` unpacks .dsops/dsops.tgz (a pack-ops output carried back) instead of compiling the ops again (~1 min).
# `run` logs into $OUT/run-TAG.log as it goes (what comes back of a call cut off by its time limit) and uses the
# reference config (Qwen3-0.6B shape, GSM8K prompts, 64 prompts per step, 512 new tokens, bf16, actor lr 1e-6,
# critic lr 1e-5; batch geometry: the GPU defaults, `zbench.config.cuda_defaults`) and stops itself after
# $RUN_BUDGET_S seconds (default 540) with SIGINT, so the run root is closed properly (unfinished cases
# recorded as interrupted) and packed even when time runs out; with $RUN_UNTIL (an epoch second: the end of the
# call) sooner where that leaves a minute to close and pack it, however long the set-up before took;
# $STEP_TIMEOUT_S (default 400) stops a hung case.
# With FLOOR=1, `run` then measures the bare-DeepSpeed floors of the cases it ran (`zbench bench floor --like`,
# ~1 min per floor, outside RUN_BUDGET_S, bounded by $FLOOR_BUDGET_S (default 900) and by the epoch second
# $FLOOR_UNTIL if set) into the run root's floors.jsonl, so `zbench report` sets the phases against floors from
# the same machine and call.
# Needs GSM8K jsonl in $GSM8K_DIR (default .gsm8k/) and zbench importable (pip install -e ., or a kit on PYTHONPATH).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ngpu() { python3 -c 'import torch; print(torch.cuda.device_count())'; }
step=${1:-}; shift || true

case $step in
prep-once)
  if [ ! -f /tmp/zbench-gsm8k/train.parquet ]; then
    bash "$0" prep > "$out/prep.log" 2>&1 || { cat "$out/prep.log"; exit 1; }
  fi
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done  # prep compiles the ops in the background
  ;;
prep)
  python3 -m zbench env --json > "$out/env.json" 2>&1
  python3 -m zbench data gsm8k --src "${GSM8K_DIR:-.gsm8k}" --out /tmp/zbench-gsm8k > /dev/null || exit 1
  python3 -m zbench model qwen3-0.6b
  if [ -f .dsops/dsops.tgz ]; then mkdir -p ~/.cache && tar -xzf .dsops/dsops.tgz -C ~/.cache; fi
  # compile DeepSpeed's fused (GPU) and CPU Adam now, in the background, instead of inside the first case
  nohup python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder as C, FusedAdamBuilder as F; F().load(); C().load()' \
    > /tmp/zbench-ops.log 2>&1 &
  ;;
gen)
  modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(generate graph)
  for decode in "${modes[@]}"; do
    python3 -m zbench bench gen --model qwen3-0.6b --prompts 64 --new-tokens 512 --decode "$decode" \
      | tail -n 1 | tee -a "$out/bench_generate.jsonl"
  done
  ;;
floor)  # every stage in "$1" with every offload in "$2", one after another in the same processes
  args=(); for s in $1; do args+=(--stage "$s"); done; for o in $2; do args+=(--offload "$o"); done
  for h in ${FLOOR_HEADS:-lm}; do args+=(--head "$h"); done
  python3 -m zbench bench floor --model qwen3-0.6b "${args[@]}" --seqs "$3" --seq-len "$4" --micro "${FLOOR_MICRO:-8}" \
    --world-size "$(ngpu)" --warmup 1 --steps 4 | grep '^{' | tee -a "$out/floors.jsonl"
  ;;
run)
  matrix=$1; cases=$2; steps=$3; shift 3
  tag=gpu-$(basename "$matrix" .yaml)${RUN_TAG:+-$RUN_TAG}  # a shipped matrix by name, or a matrix file
  budget=${RUN_BUDGET_S:-540}
  if [ -n "${RUN_UNTIL:-}" ] && [ $(( RUN_UNTIL - $(date +%s) - 60 )) -lt "$budget" ]; then
    budget=$(( RUN_UNTIL - $(date +%s) - 60 ))
  fi
  if [ "$budget" -lt 30 ]; then echo "no time left for the run: $budget s before RUN_UNTIL's minute" >&2; exit 1; fi
  echo "run budget: $budget s"
  timeout -s INT -k 30 "$budget" python3 -m zbench run "$matrix" --cases "$cases" --steps "$steps" \
    --seed 7777 --results-dir /tmp/zbench-results --tag "$tag" --retries 0 --step-timeout "${STEP_TIMEOUT_S:-400}" \
    --set model.path=qwen3-0.6b --set trainer.world_size="$(ngpu)" \
    --set data.train_files=/tmp/zbench-gsm8k/train.parquet --set data.max_prompt_length=512 \
    --set trainer.train_batch_size=64 --set actor.ppo_mini_batch_size=64 --set rollout.max_new_tokens=512 \
    --set actor.lr=1e-6 --set critic.lr=1e-5 "$@" 2>&1 | tee "$out/run-$tag.log" | tail -n 30
  root=$(ls -d /tmp/zbench-results/"$tag"_* | tail -n 1)
  if [ -n "${FLOOR:-}" ]; then  # the floors of the cases just run, same GPUs and host, into the run root
    fb=${FLOOR_BUDGET_S:-900}
    [ -n "${FLOOR_UNTIL:-}" ] && [ $(( FLOOR_UNTIL - $(date +%s) )) -lt "$fb" ] && fb=$(( FLOOR_UNTIL - $(date +%s) ))
    if [ "$fb" -gt 30 ]; then  # stopped with SIGINT at the budget, keeping the floors measured by then
      timeout -s INT -k 30 "$fb" python3 -m zbench bench floor --like "$root" --warmup 1 --steps 4 \
        | grep '^{' > /tmp/zbench-floors.out
      echo "$(grep -vc '"status": "oom"' /tmp/zbench-floors.out) floors measured," \
        "$(grep -c '"status": "oom"' /tmp/zbench-floors.out) out of memory"
    else echo "no time left for floors"; fi
  fi
  # a step profile's traces (tens of MB each) stay on the machine; its text reports come back
  tar --exclude=ckpt --exclude='*.json.gz' -czf "$out/run-$tag.tgz" -C "$(dirname "$root")" "$(basename "$root")"
  cut -f1-17 "$root/summary.tsv"
  ;;
tune)  # $TUNE_BUDGET_S bounds the tune (default 420 s, --time-budget, shared among the cases: a stopped tune keeps
  # what it found). A case's first trial starts its session: 1.5-2.5 min for GRPO on an H100, about 5 min for PPO on a
  # fresh machine (vLLM's compile cache empty, actor and critic compiled); each later trial about 20 s.
  matrix=$1; cases=$2; shift 2
  ref=(--set model.path=qwen3-0.6b --set trainer.world_size="$(ngpu)" --set rollout.backend=vllm
       --set data.train_files=/tmp/zbench-gsm8k/train.parquet --set data.max_prompt_length=512
       --set trainer.train_batch_size=64 --set actor.ppo_mini_batch_size=64 --set rollout.max_new_tokens=512
       --set actor.lr=1e-6 --set critic.lr=1e-5)
  timeout -s INT -k 30 $(( ${TUNE_BUDGET_S:-420} + 120 )) python3 -m zbench tune "$matrix" --cases "$cases" --seed 7777 \
    --results-dir /tmp/zbench-results --tag "gpu-tune-$matrix" --time-budget "${TUNE_BUDGET_S:-420}" "${ref[@]}" "$@" \
    2>&1 | grep '^\[tune\]\|^trials\|^tuned\|stopped' | tail -n 40
  root=$(ls -d /tmp/zbench-results/gpu-tune-"$matrix"_* | tail -n 1)
  tar -czf "$out/tune-$matrix.tgz" -C "$(dirname "$root")" "$(basename "$root")"
  if [ -f "$root/tuned.yaml" ] && [ "${TUNED_STEPS:-10}" -gt 0 ]; then
    timeout -s INT -k 30 "${RUN_BUDGET_S:-540}" python3 -m zbench run "$root/tuned.yaml" --steps "${TUNED_STEPS:-10}" \
      --seed 7777 --results-dir /tmp/zbench-results --tag "gpu-tuned-$matrix" --retries 0 2>&1 | tail -n 15
    run=$(ls -d /tmp/zbench-results/gpu-tuned-"$matrix"_* | tail -n 1)
    tar --exclude=ckpt -czf "$out/run-tuned-$matrix.tgz" -C "$(dirname "$run")" "$(basename "$run")"
  fi
  ;;
update)
  [ -d /tmp/zbench-gsm8k ] || bash "$0" prep > "$out/prep.log" 2>&1
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done  # the ops prep compiles in the background
  variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  prof=(); rm -rf /tmp/update-profiles  # this call's reports only
  [ -n "${UPDATE_PROFILE:-}" ] && prof=(--profile-dir /tmp/update-profiles --profiler $UPDATE_PROFILE)
  timeout -s INT "${UPDATE_BUDGET_S:-420}" python3 benchmarks/actor_update.py --model qwen3-0.6b \
    --data /tmp/zbench-gsm8k/train.parquet --seqs 128 --n 4 --response-len 512 --repeats 3 "${variants[@]}" \
    "${prof[@]}" 2>&1 | tee "$out/update${UPDATE_TAG:-}.log" | grep '^{' | tee "$out/update${UPDATE_TAG:-}.jsonl" \
    | cut -c1-400
  if [ -d /tmp/update-profiles ]; then  # the text reports come back in one file; the traces stay here
    tar --exclude='*.json.gz' -czf "$out/update-profiles${UPDATE_TAG:-}.tgz" -C /tmp update-profiles
  fi
  ;;
loop)
  CUDA_VISIBLE_DEVICES=0 timeout "${LOOP_S:-420}" python3 benchmarks/graph_decode_profile.py --model qwen3-0.6b \
    --batch 128 --n 4 --data /tmp/zbench-gsm8k/train.parquet --prompt-width 512 --attention triton --repeats 5 \
    --top 40 --gaps "$@" > "$out/loop${LOOP_TAG:-}.jsonl" 2> "$out/loop${LOOP_TAG:-}.log"
  python3 - "$out/loop${LOOP_TAG:-}.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print({k: v for k, v in d.items() if not isinstance(v, (list, dict)) and k not in ("model", "device", "data")})
PY
  ;;
tests)
  gpus=$(ngpu); [ "$gpus" -ge 1 ] || { echo "no GPU: the GPU-marked tests would all skip" >&2; exit 1; }
  python3 -c 'import pytest' 2> /dev/null || python3 -m pip install -q --no-index --find-links .pyt pytest > /dev/null
  CUDA_VISIBLE_DEVICES=$(( gpus - 1 )) timeout "${TESTS_S:-420}" python3 -m pytest -m gpu -p no:cacheprovider -q \
    -o log_level=WARNING tests/test_rollout.py tests/test_race_sampling.py "$@" > "$out/check-tests.txt" 2>&1
  rc=$?
  echo "tests rc $rc" >> "$out/check-tests.txt"
  grep -E '^(FAILED|ERROR|E  )| in [0-9.]+s|tests rc' "$out/check-tests.txt" | tail -n 30
  exit $rc
  ;;
pack-ops)
  tar -czf "$out/dsops.tgz" -C ~/.cache torch_extensions && ls -la "$out/dsops.tgz"
  ;;
*)
  echo "unknown step $step: prep | prep-once | gen | floor | run | tune | update | loop | tests | pack-ops" >&2; exit 2
  ;;
esac
