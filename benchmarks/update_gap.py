"""Where an RL update's time goes beyond bare DeepSpeed: the engine's own actor and critic updates (the worker
methods a case runs) beside `zbench bench floor`'s loop on the same DeepSpeed engine, on one rank.

    python benchmarks/update_gap.py --model qwen3-0.6b --stage 1 --data /tmp/zbench-gsm8k/train.parquet \
        --seqs 32 --micro 8 --profile-dir /tmp/gap          # a GPU
    python benchmarks/update_gap.py                          # CPU, the tiny model: a smoke run

The batch is a real step's shape: `--seqs` GSM8K prompts (or generated problems without `--data`), left-padded
as the trainer pads them, each with a `--response-len`-token random response. Variants, each timed `--repeats`
times after one warm-up (median seconds per optimizer step, and tokens per second over prompt + response
tokens, as the report counts them):

- `actor/masked`, `actor/maskless`: `update_actor` with `model.maskless_attention` off and on;
- `actor/maskless+empty_cache`: the same after `torch.cuda.empty_cache()`, as a step does after generation;
- `critic/masked`, `critic/maskless`: `update_critic`;
- `bare/lm`, `bare/value`: the floor's loop (`zbench.bench.bare_steps`) on the actor's and the critic's engines
  at the mean sequence length, the floor's shape; `bare/lm@width` at the mean micro-batch width the masked
  layout trains on (its padding included).

One JSON line per variant on stdout; with `--profile-dir`, one profiled call of each update variant there
(`zbench.engine.profiling`: GPU-busy share and the top operators).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _config(args: argparse.Namespace) -> Any:
    from zbench.config import from_dict

    cfg = from_dict({
        "algorithm": "ppo", "seed": 7777, "model": {"path": args.model},
        "data": {"train_files": args.data, "max_prompt_length": 512},
        "rollout": {"backend": "hf", "n": 1, "max_new_tokens": args.response_len},
        "actor": {"ppo_mini_batch_size": args.seqs, "micro_batch_size_per_gpu": args.micro,
                  "forward_micro_batch_size_per_gpu": 2 * args.micro},
        "critic": {"micro_batch_size_per_gpu": args.micro, "forward_micro_batch_size_per_gpu": 2 * args.micro},
        "zero": {"stage": args.stage, "offload": args.offload},
        "trainer": {"world_size": 1, "train_batch_size": args.seqs},
    })
    return cfg


def _batch(cfg: Any, model_path: str, seqs: int, response_len: int) -> dict[str, torch.Tensor]:
    """A step's batch as the trainer builds it: left-padded prompts, right-padded responses, masks, positions."""
    from transformers import AutoTokenizer

    from zbench.data import load_prompts, synthetic_problems
    from zbench.engine.batches import left_pad, sequence_batch
    from zbench.engine.trainer import PromptStream

    tok = AutoTokenizer.from_pretrained(model_path)
    d = cfg.data
    rows = synthetic_problems(4 * seqs, 0, "train") if d.train_files == "synthetic" else load_prompts(d.train_files)
    stream = PromptStream(rows[: 8 * seqs], tok, seqs, cfg.seed, True, d.max_prompt_length)
    p_ids, p_mask = left_pad([stream.ids[i] for i in stream.indices(1)], tok.pad_token_id or 0)
    g = torch.Generator().manual_seed(cfg.seed)
    responses = torch.randint(0, len(tok), (seqs, response_len), generator=g)
    return sequence_batch(p_ids, p_mask, responses, torch.ones_like(responses))


def _timed(fn: Callable[[], Any], repeats: int, on_cuda: bool, before: Callable[[], None] | None = None) -> list[float]:
    times = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--offload", default="none")
    ap.add_argument("--data", default="synthetic", help="a GSM8K parquet from `zbench data gsm8k`")
    ap.add_argument("--seqs", type=int, default=32, help="sequences per optimizer step (one rank's share)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--profile-dir", default="")
    args = ap.parse_args()

    from zbench.bench import bare_steps
    from zbench.engine.batches import forward_batches
    from zbench.engine.cluster import free_port
    from zbench.engine.workers import CriticWorker, PolicyWorker
    from zbench.models import resolve_model

    cfg = _config(args)
    model_path = str(resolve_model(args.model))
    case_dir = tempfile.mkdtemp(prefix="zbench-gap-")
    actor = PolicyWorker(cfg, 0, 1, case_dir, model_path)
    actor.join("127.0.0.1", free_port())
    actor.setup()
    critic = CriticWorker(cfg, 0, 1, case_dir, model_path)
    critic.setup()
    on_cuda = actor.on_cuda
    batch = _batch(cfg, model_path, args.seqs, args.response_len)
    batch.update(actor.compute_log_prob(batch))
    batch.update(critic.compute_values(batch))
    g = torch.Generator().manual_seed(1)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    batch["returns"] = batch["values"] + torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]

    tokens = int(batch["attention_mask"].sum())
    mean_len = round(tokens / args.seqs)
    widths = [mb["input_ids"].shape[1] for mb in forward_batches(batch, args.micro)]
    mean_width = round(statistics.mean(widths))
    accum = args.seqs // args.micro
    layouts = {"masked": False, "maskless": True}

    def with_layout(worker: Any, maskless: bool) -> None:
        worker.cfg = dataclasses.replace(worker.cfg, model=dataclasses.replace(worker.cfg.model,
                                                                               maskless_attention=maskless))

    def run(name: str, fn: Callable[[], Any], before: Callable[[], None] | None = None) -> None:
        times = _timed(fn, args.repeats, on_cuda, before)
        step = statistics.median(times)
        print(json.dumps({"variant": name, "step_s_median": round(step, 4), "step_s_all": [round(t, 4) for t in times],
                          "tokens_per_s": round(tokens / step), "seqs": args.seqs, "micro": args.micro,
                          "mean_len": mean_len, "mean_width": mean_width, "stage": args.stage,
                          "offload": args.offload, "model": args.model,
                          "device": torch.cuda.get_device_name() if on_cuda else "cpu"}), flush=True)

    updates = {"actor": (actor, lambda: actor.update_actor(batch)),
               "critic": (critic, lambda: critic.update_critic(batch))}
    for role, (worker, update) in updates.items():
        for layout, maskless in layouts.items():
            with_layout(worker, maskless)
            run(f"{role}/{layout}", update)
            if role == "actor" and maskless and on_cuda:
                run("actor/maskless+empty_cache", update, before=torch.cuda.empty_cache)
    for name, engine, head, width in (("bare/lm", actor.engine, "lm", mean_len),
                                      ("bare/lm@width", actor.engine, "lm", mean_width),
                                      ("bare/value", critic.engine, "value", mean_len)):
        g = torch.Generator().manual_seed(0)
        run(name, lambda engine=engine, head=head, width=width, g=g: bare_steps(engine, head, args.micro, width,
                                                                                 accum, 1, g))
    if args.profile_dir:
        for role, (worker, update) in updates.items():
            for layout, maskless in layouts.items():
                with_layout(worker, maskless)
                worker.profile_start()
                update()
                phases = worker.profiler.stop(Path(args.profile_dir), f"{role}-{layout}",
                                              f"{role} update, {layout} layout, {args.model} ZeRO-{args.stage}")
                print(json.dumps({"profile": f"{role}/{layout}", "phases": [dataclasses.asdict(p) for p in phases]}),
                      flush=True)
    actor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
