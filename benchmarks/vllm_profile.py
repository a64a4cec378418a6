"""Where a colocated vLLM rollout spends its time, on one GPU: for each engine variant, the rollout's wall time,
the GPU's kernel time over it (torch.profiler), and the host's hottest Python functions (cProfile).

One engine is built as a case builds it (`zbench.engine.vllm_rollout.build`), with further vLLM engine arguments
on top (`--variant`, a JSON object `{"name": ..., "engine": {...}}`; one variant per process, as vLLM keeps
process-wide state; `"in_process": false` runs vLLM's engine core in a process of its own, as vLLM does by default,
where zbench keeps it in the trainer's process for the weight push). Two more variant keys make the process more like
a trainer's rank: `"nice": N` runs it at that niceness (Ray raises its workers' niceness by 15, its
`RAY_worker_niceness`), and `"cycle": true` puts the engine to sleep after each rollout and pushes the checkpoint's
weights into it before the next, as the trainer does (the push wakes it; it is not timed, as the trainer times it
apart; a rollout's time then includes the sleep, as the trainer's gen phase does). `"env": {...}` sets environment
variables before vLLM is imported (torch already is), e.g. `{"VLLM_USE_V2_MODEL_RUNNER": "0"}` for vLLM's V1 model
runner (vLLM 0.26 runs Qwen3 on its V2 runner; V1 was slower at 32 rows, results/reference/h200x2-v1-runner-20261127).
GSM8K prompts are repeated `--n` times, as GRPO samples them. Measured:

- `generate`: median of `--repeats` timed rollouts after one warm-up, with per-request seeds (what zbench sends,
  from an empty prefix cache, as after the trainer's weight push) and with one unseeded request list (vLLM then
  samples the whole batch in one call);
- `profile`: one rollout under torch.profiler: GPU kernel time in all and per decode step against the wall time
  (a GPU busy far below 100 % means the host, not the GPU, sets the pace), and the top kernels;
- `host`: one rollout under cProfile, the functions with the most own time.

    python benchmarks/vllm_profile.py --data data/gsm8k/train.parquet --prompts 32 --n 4 --new-tokens 512 \
        --variant '{"name": "sync", "engine": {"async_scheduling": false}}'

One JSON line per measurement on stdout, each naming the GPUs the process saw (`CUDA_VISIBLE_DEVICES`). Several
processes, one per GPU, measure at the same time as a case's ranks generate: `--barrier DIR --parties N` holds each
after its engine has started until N of them have.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

# vLLM logs to stdout by default, between this script's JSON lines (the sleep / wake cycle logs at every rollout):
# its log goes to stderr instead, as in vLLM's own benchmarks (set before vLLM is imported, here or by an importer)
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def _config(args: argparse.Namespace) -> Any:
    from zbench.config import from_dict

    return from_dict({
        "algorithm": "grpo" if args.n > 1 else "ppo", "seed": 7777, "model": {"path": args.model},
        "data": {"train_files": args.data, "max_prompt_length": 512},
        "rollout": {"backend": "vllm", "n": args.n, "max_new_tokens": args.new_tokens, "kv_cache_fit": True},
        "actor": {"ppo_mini_batch_size": args.prompts, "micro_batch_size_per_gpu": args.n},
        "trainer": {"world_size": 1, "train_batch_size": args.prompts},
    })


def _emit(**row: Any) -> None:
    row["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(json.dumps(row), flush=True)


def variant_env(variant: dict[str, Any]) -> dict[str, str]:
    """A variant's `"env"`: environment variables (names to strings or numbers) for this process, set before vLLM
    is imported."""
    env = variant.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str | int | float)
                                            and not isinstance(v, bool) for k, v in env.items()):
        raise SystemExit(f'--variant: "env" must map variable names to strings or numbers, got {env!r}')
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in env:  # zbench.engine.vllm_rollout sets it from in_process
        raise SystemExit('--variant: "env" may not set VLLM_ENABLE_V1_MULTIPROCESSING; use "in_process": false')
    return {k: str(v) for k, v in env.items()}


def _barrier(where: str, parties: int, timeout_s: float = 600.0) -> float:
    """Mark this process ready in `where` and wait until `parties` processes have; returns the seconds waited."""
    folder = Path(where)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    t0 = time.perf_counter()
    while len(list(folder.iterdir())) < parties:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"--barrier {where}: {len(list(folder.iterdir()))} of {parties} parties in {timeout_s} s")
        time.sleep(0.2)
    return time.perf_counter() - t0


def kernel_table(prof: torch.profiler.profile, top: int) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
    """Total GPU kernel time (s), the `top` kernels by their total time, and the `top` CPU operators by self time
    (what the host spent launching: `cudaGraphLaunch`, `Command Buffer Full` where the launch queue was full). The
    kernels are the GPU's own events only, since a CPU operator's row (`aten::mm`) repeats the time of the kernels it
    launched (`zbench.engine.profiling.operator_times`, seconds where torch's `key_averages` takes most of a minute
    for a rollout's 200,000 kernels)."""
    from zbench.engine.profiling import operator_times

    device, cpu = operator_times(list(prof.profiler.kineto_results.events()))
    rows = [{"kernel": o.name[:90], "calls": o.calls, "total_ms": round(o.ns / 1e6, 2)} for o in device if o.ns > 0]
    host = [{"op": o.name[:90], "calls": o.calls, "self_ms": round(o.ns / 1e6, 3)} for o in cpu if o.ns >= 1000]
    return sum(o.ns for o in device) / 1e9, rows[:top], host[:top]


def step_prompts(args: argparse.Namespace) -> tuple[Any, str, torch.Tensor, torch.Tensor, int, list[int]]:
    """One step's prompts from `args.data`, each `args.n` times, left-padded as the trainer pads them:
    (config, model path, ids, mask, pad id, eos ids)."""
    from transformers import AutoTokenizer

    from zbench.data import load_prompts, synthetic_problems
    from zbench.engine.batches import left_pad
    from zbench.engine.trainer import PromptStream
    from zbench.models import resolve_model, special_ids

    cfg = _config(args)
    model_path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id, eos_ids = special_ids(model_path)
    d = cfg.data
    rows = synthetic_problems(4 * args.prompts, 0, "train") if d.train_files == "synthetic" else load_prompts(d.train_files)
    stream = PromptStream(rows[: 8 * args.prompts], tok, args.prompts, cfg.seed, True, d.max_prompt_length)
    ids, mask = left_pad([stream.ids[i] for i in stream.indices(1) for _ in range(args.n)], pad_id)
    return cfg, model_path, ids, mask, pad_id, eos_ids


def engine_and_batch(args: argparse.Namespace,
                     variant: dict[str, Any]) -> tuple[Any, Any, torch.Tensor, torch.Tensor, list[int]]:
    """A case's vLLM engine on this GPU (`variant`: its further engine arguments) and one step's prompts
    (`step_prompts`): (config, rollout, ids, mask, eos ids)."""
    from transformers import AutoConfig

    from zbench.engine import vllm_rollout

    cfg, model_path, ids, mask, pad_id, eos_ids = step_prompts(args)
    tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
    rollout = vllm_rollout.build(model_path, cfg, pad_id, eos_ids, 0, tied, engine_args=variant.get("engine"),
                                 in_process=variant.get("in_process", True))
    return cfg, rollout, ids, mask, eos_ids


def checkpoint_weights(model: str) -> list[tuple[str, torch.Tensor]]:
    """The model's own weights on this GPU under their Hugging Face names, as the trainer's actor pushes them."""
    from transformers import AutoModelForCausalLM

    from zbench.models import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(model)), dtype=torch.bfloat16)
    return [(name, t.detach().cuda()) for name, t in hf.named_parameters()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--data", default="synthetic", help="a GSM8K parquet from `zbench data gsm8k`, or synthetic")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", default='{"name": "default", "engine": {}}')
    ap.add_argument("--barrier", help="a folder the processes measuring together mark themselves ready in")
    ap.add_argument("--parties", type=int, default=1, help="processes that meet at --barrier")
    args = ap.parse_args()
    variant = json.loads(args.variant)
    name = variant["name"]
    env = variant_env(variant)
    os.environ.update(env)

    from vllm import SamplingParams, TokensPrompt

    from zbench.engine import vllm_rollout
    from zbench.engine.profiling import host_functions

    cycle = bool(variant.get("cycle"))
    if cycle and not variant.get("in_process", True):
        raise SystemExit('--variant: "cycle" pushes weights into the engine, which needs it in this process: drop '
                         '"in_process": false')
    if "nice" in variant:
        os.setpriority(os.PRIO_PROCESS, 0, int(variant["nice"]))
    start = time.perf_counter()
    cfg, rollout, ids, mask, eos_ids = engine_and_batch(args, variant)
    _emit(variant=name, measure="engine_start_s", value=round(time.perf_counter() - start, 2),
          device=torch.cuda.get_device_name())
    weights = checkpoint_weights(args.model) if cycle else None
    _emit(variant=name, measure="process", niceness=os.getpriority(os.PRIO_PROCESS, 0), cycle=cycle, env=env)
    if args.barrier:
        _emit(variant=name, measure="barrier_wait_s", value=round(_barrier(args.barrier, args.parties), 2))

    prompts = [TokensPrompt(prompt_token_ids=p) for p in vllm_rollout.strip_left_padding(ids, mask)]
    unseeded = SamplingParams(n=1, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
                              max_tokens=args.new_tokens, stop_token_ids=eos_ids, detokenize=False)

    def push() -> None:
        """Untimed, as the trainer times it apart (update_weights): the engine sleeps since its last rollout (level
        2: weights and KV cache dropped); the push wakes it, refills its weights and empties its prefix cache."""
        if weights is not None:
            rollout.load_weights(iter(weights))

    def ready() -> None:
        """Untimed: the state a trainer's rollout starts from, an empty prefix cache (after the weight push)."""
        if weights is None:
            rollout.llm.reset_prefix_cache()
        push()

    engine_s: list[float] = []  # of the seeded rollouts being timed

    def seeded(seed: int) -> int:
        out = rollout.generate(ids, mask, seed, sleep=cycle)  # the trainer's gen phase: generate (and sleep)
        engine_s.append(rollout.seconds["engine"])  # inside vLLM's generate only, as perf/rollout_engine_s
        return int(out["response_mask"].sum())

    def one_call(seed: int) -> int:
        outs = rollout.llm.generate(prompts, unseeded, use_tqdm=False)
        if cycle:
            rollout.sleep()
        return sum(len(o.outputs[0].token_ids) for o in outs)

    for label, before, fn in (("per_request_seeds", ready, seeded), ("unseeded", push, one_call)):
        times, tokens = [], []
        engine_s.clear()
        for rep in range(args.repeats + 1):
            before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens.append(fn(1000 + rep))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = statistics.median(times[1:])
        _emit(variant=name, measure="generate", sampling=label, sequences=len(ids), median_s=round(best, 3),
              all_s=[round(t, 3) for t in times[1:]], cold_s=round(times[0], 3),
              generated_tokens_per_s=round(statistics.mean(tokens[1:]) / best),
              ms_per_decode_step=round(1000 * best / args.new_tokens, 2),
              **({"engine_median_s": round(statistics.median(engine_s[1:]), 3),
                  "engine_all_s": [round(t, 3) for t in engine_s[1:]]} if engine_s else {}))

    ready()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        seeded(7)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gpu_s, kernels, _host = kernel_table(prof, 12)
    seen = bool(kernels)  # the profiler sees no kernel of an engine running in a process of its own
    _emit(variant=name, measure="profile", wall_s=round(wall, 3), gpu_kernel_s=round(gpu_s, 3) if seen else None,
          gpu_busy=round(gpu_s / wall, 3) if seen else None,
          gpu_ms_per_decode_step=round(1000 * gpu_s / args.new_tokens, 2) if seen else None, top_kernels=kernels)

    ready()
    host = cProfile.Profile()
    t0 = time.perf_counter()
    host.enable()
    seeded(8)
    host.disable()
    wall = time.perf_counter() - t0
    top = host_functions(pstats.Stats(host), 20)  # as trainer.profiler=python lists a phase's functions
    _emit(variant=name, measure="host", wall_s=round(wall, 3),
          top_own_time=[{"fn": f.function, "calls": f.calls, "own_s": round(f.own_s, 3),
                         "cum_s": round(f.cumulative_s, 3)} for f in top])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
