"""A GRPO actor update at several geometries on one rank: the engine's own `update_actor` (the worker method a
case runs) on one step's batch, each variant on a freshly built DeepSpeed engine in this process.

    python benchmarks/actor_update.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet --seqs 128 \
        --variant z2-mb8:zero.stage=2,actor.micro_batch_size_per_gpu=8 \
        --variant z2-mb32-ckpt:zero.stage=2,actor.micro_batch_size_per_gpu=32,model.gradient_checkpointing=true
    python benchmarks/actor_update.py            # CPU, the tiny model, two variants: a smoke run

The batch is a real GRPO step's shape on one rank: `--seqs` sequences (`--seqs / --n` GSM8K prompts, or generated
problems without `--data`, each repeated `--n` times), left-padded as the trainer pads them, each with a
`--response-len`-token random response (random weights rarely stop early, so responses run to full length). The
update runs one epoch of one mini-batch, the old log-probs taken from its own forward, as the defaults run it.

Each variant is `NAME:KEY=VALUE,...` (config keys, as `--set` takes them), timed `--repeats` times after one warm-up.
One JSON line per variant on stdout: median seconds per update, tokens per second (prompt + response tokens, as
the report counts them), the update's model FLOP utilisation (as `perf/mfu/actor` counts it,
`zbench.engine.records.training_flops`: the decoder's 6 x parameters and the attention per token, the head on the
response tokens, a checkpointed forward's recomputation not counted, over the GPU's dense bf16 peak), and torch's
peak allocated / reserved memory over the timed updates. With `--profile-dir`, one profiled update per variant and
`--profiler` there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _config(args: argparse.Namespace, overrides: list[str]) -> Any:
    from zbench.config import from_dict, parse_set, set_dotted

    prompts = args.seqs // args.n
    raw: dict[str, Any] = {
        "algorithm": "grpo", "seed": 7777, "model": {"path": args.model},
        "data": {"train_files": args.data, "max_prompt_length": 512},
        "rollout": {"backend": "hf", "n": args.n, "max_new_tokens": args.response_len},
        "actor": {"ppo_mini_batch_size": prompts, "lr": 1e-6},
        "trainer": {"world_size": 1, "train_batch_size": prompts},
    }
    for item in overrides:
        set_dotted(raw, *parse_set(item))
    return from_dict(raw)


def _batch(cfg: Any, model_path: str, seqs: int, n: int, response_len: int) -> dict[str, torch.Tensor]:
    """A GRPO step's batch as the trainer builds it: each prompt n times, left-padded; responses; advantages."""
    from transformers import AutoTokenizer

    from zbench.data import load_prompts, synthetic_problems
    from zbench.engine.batches import left_pad, sequence_batch
    from zbench.engine.trainer import PromptStream

    tok = AutoTokenizer.from_pretrained(model_path)
    d, prompts = cfg.data, seqs // n
    rows = synthetic_problems(4 * prompts, 0, "train") if d.train_files == "synthetic" else load_prompts(d.train_files)
    stream = PromptStream(rows[: 8 * prompts], tok, prompts, cfg.seed, True, d.max_prompt_length)
    ids = [stream.ids[i] for i in stream.indices(1) for _ in range(n)]
    p_ids, p_mask = left_pad(ids, tok.pad_token_id or 0)
    g = torch.Generator().manual_seed(cfg.seed)
    responses = torch.randint(0, len(tok), (seqs, response_len), generator=g)
    batch = sequence_batch(p_ids, p_mask, responses, torch.ones_like(responses))
    batch["advantages"] = torch.randn(responses.shape, generator=g)
    return batch


def _measure(name: str, overrides: list[str], args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    from zbench.engine.cluster import free_port
    from zbench.engine.profiling import PhaseProfile
    from zbench.engine.records import peak_flops, training_flops
    from zbench.engine.workers import PolicyWorker

    cfg = _config(args, overrides)
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-update-"), model_path)
    worker.join("127.0.0.1", free_port())
    started = time.perf_counter()
    worker.setup()
    setup_s = time.perf_counter() - started
    on_cuda = worker.on_cuda
    batch = _batch(cfg, model_path, args.seqs, args.n, args.response_len)
    tokens = int(batch["attention_mask"].sum())
    times: list[float] = []
    for i in range(args.repeats + 1):
        if on_cuda:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        worker.update_actor(batch)
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in worker.engine.module.parameters())
    mc = worker.engine.module.config
    flops = training_flops(params, mc, batch["attention_mask"].sum(-1).tolist(), int(batch["response_mask"].sum()))
    peak = peak_flops(torch.cuda.get_device_name()) if on_cuda else None
    out = {"variant": name, "set": overrides, "update_s_median": round(step, 4),
           "update_s_all": [round(t, 4) for t in times[1:]], "warmup_s": round(times[0], 2),
           "setup_s": round(setup_s, 1), "tokens": tokens, "tokens_per_s": round(tokens / step),
           "mfu": round(flops / step / peak, 4) if peak else None,
           "torch_peak_alloc_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_cuda else None,
           "torch_peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2) if on_cuda else None,
           "seqs": args.seqs, "model": args.model,
           "device": torch.cuda.get_device_name() if on_cuda else "cpu"}
    for kind in args.profiler if args.profile_dir else []:  # whatever trainer.profiler the variant sets
        worker.profiler.start(kind)
        worker.update_actor(batch)
        stem = name if kind == "torch" else f"{name}-{kind}"
        phases = worker.profiler.stop(Path(args.profile_dir), stem, f"actor update, {name}, {args.model}, {kind}")
        out[f"profile_{kind}"] = [
            {"phase": p.phase, "wall_ms": round(p.wall_ms, 1)}
            | ({"busy_share": round(p.busy_share, 3)} if isinstance(p, PhaseProfile) else {}) for p in phases]
    worker.engine.destroy()  # the process group stays for the next variant (DeepSpeed keeps its groups)
    del worker
    _release()
    return out


def _release() -> None:
    """Drop one variant's engine before the next is built: ZeRO-3's process-wide state and the cached blocks."""
    from zbench.bench import _release_zero3_globals

    _release_zero3_globals()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    from zbench.config import PROFILERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default="synthetic", help="a GSM8K parquet from `zbench data gsm8k`")
    ap.add_argument("--seqs", type=int, default=16, help="sequences per update on this rank (prompts x n)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--profile-dir", default="")
    ap.add_argument("--profiler", nargs="+", choices=PROFILERS, default=["torch"],
                    help="with --profile-dir, one profiled update per variant under each, in this order: torch "
                         "(`<variant>.txt`: GPU busy and idle, where the GPU waited on the host, the top operators) "
                         "and python (`<variant>-python.txt`: cProfile, the functions with the most own time)")
    args = ap.parse_args()
    variants = args.variant or ["plain-head:model.fused_head=false", "fused-head:model.fused_head=true"]

    from zbench.models import resolve_model

    model_path = str(resolve_model(args.model))
    for spec in variants:
        name, _, sets = spec.partition(":")
        overrides = [s for s in sets.split(",") if s]
        try:
            result = _measure(name, overrides, args, model_path)
        except torch.OutOfMemoryError as err:  # a geometry that does not fit is a result, not the end
            result = {"variant": name, "set": overrides, "error": f"out of memory: {str(err).splitlines()[0]}"}
            _release()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
