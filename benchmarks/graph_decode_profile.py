"""Where zbench's CUDA-graph decode loop (`zbench.engine.rollout.GraphDecoder`, `rollout.backend=hf` with
`rollout.cuda_graph=true`) spends a rollout's time, on one GPU, for each batch size and prompt width asked:

- `generate`: median and spread of `--repeats` timed rollouts after one warm-up (the warm-up compiles and records
  the decode step for this batch and cache length; its time is reported as `first_s`);
- `profile`: one rollout under torch.profiler: GPU kernel time in all and per decode step against the wall time
  (GPU busy near 100 % means the GPU, not the host, sets the pace), the top kernels and the host's top operators
  by self time (what launching the step's graphs cost the host).

With `--stop none` no EOS is given, so every response runs to `--new-tokens`; with `--stop model` the model's pad
and EOS ids are, as a run passes them (a random-weight shape preset still runs every step: not every row draws
one). One JSON line per measurement on stdout. Compare with `benchmarks/vllm_profile.py` at the same rows and tokens:

    python benchmarks/graph_decode_profile.py --model qwen3-0.6b --batch 32 --width 256 --new-tokens 512
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import statistics
import time
from typing import Any

import torch
from decode_attention_bench import on_off  # this script's folder
from vllm_profile import kernel_table, step_prompts  # this script's folder; imports no vLLM

from zbench.config import GRAPH_STEPS_PER_GRAPH
from zbench.engine.profiling import DeviceTimeline, idle_class_names
from zbench.engine.rollout import COMPILE_MODES, DECODE_ATTENTION, inductor_has_pdl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--width", type=int, nargs="+", default=[256], help="left-padded prompt width (tokens)")
    parser.add_argument("--data", default="", help="a GSM8K parquet from `zbench data gsm8k` (or synthetic): each "
                                                   "batch is one step's prompts, --n samples each, padded as the "
                                                   "trainer pads them, as benchmarks/vllm_profile.py sends them; "
                                                   "--width is then unused")
    parser.add_argument("--n", type=int, default=1, help="with --data: samples per prompt (batch / n prompts)")
    parser.add_argument("--prompt-width", type=int, nargs="+", default=[0],
                        help="with --data: pad each batch to this width, as the replica does with the Triton "
                             "attention (`HFRollout.prompt_width`); 0: to the next multiple of 64, as the trainer "
                             "pads them (each measured in turn)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sync-every", type=int, default=64)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    parser.add_argument("--attention", nargs="+", default=["sdpa"], choices=DECODE_ATTENTION,
                        help="the decode step's attention: SDPA over the whole cache, or the Triton kernels that "
                             "read only the masked-in positions (each measured in turn, same prompts)")
    parser.add_argument("--merge", nargs="+", default=["on"], choices=("on", "off"),
                        help="q/k/v and gate/up as one matrix multiply each (GraphDecoder's default), or as "
                             "transformers runs them (each measured in turn, on a fresh copy of the model)")
    parser.add_argument("--sampler", nargs="+", default=["graph"], choices=("graph", "eager"),
                        help="where a token is drawn: inside the recorded step with its bookkeeping (GraphDecoder's "
                             "default, zbench.engine.race_sampling) or by eager kernels between replays (each "
                             "measured in turn, on a fresh copy of the model)")
    parser.add_argument("--share", nargs="+", default=["on"], choices=("on", "off"),
                        help="with --data and --n > 1: the Triton attention reads each prompt's part of the cache once "
                             "for its n samples (GraphDecoder's default, told the rows' n), or once a row (each "
                             "measured in turn, on a fresh copy of the model)")
    parser.add_argument("--compile-mode", nargs="+", default=["reduce-overhead"], choices=COMPILE_MODES,
                        help="how the decode step is compiled (GraphDecoder's compile_mode; each measured in turn, on a "
                             "fresh copy of the model): recorded as a CUDA graph, and with max-autotune its matrix "
                             "multiplies timed among Triton's templates and cuBLAS while compiling")
    on_off(parser, "--dense", "on", "the Triton attention's `DENSE`: a slice kept everywhere between its first and "
           "last kept positions loops without reading the mask (on, the default), or reads it every block (off); "
           "each measured in turn, on a fresh copy of the model")
    on_off(parser, "--one-grid", "on", "with shared prompts: the Triton attention's prefix and per-row programs in "
           "one launch (`ONE_GRID`, the default), or a launch each (off); each measured in turn, on a fresh copy of the model")
    on_off(parser, "--pdl", "on", "programmatic dependent launch for the Triton attention's kernels (`PDL`, the "
           "default) and Inductor's own (GraphDecoder compiles them with `triton.enable_pdl`): each kernel scheduled "
           "while the one before it drains (Hopper and later); each measured in turn, on a fresh copy of the model")
    parser.add_argument("--steps-per-graph", type=int, nargs="+", default=[GRAPH_STEPS_PER_GRAPH],
                        help="with the in-graph draw: decode steps captured as one CUDA graph (GraphDecoder's "
                             "steps_per_graph; 1: torch.compile records each step; default: a GPU case's default), "
                             "each measured in turn, on a fresh copy of the model")
    parser.add_argument("--stop", nargs="+", default=["none"], choices=("none", "model"),
                        help="the pad and EOS ids the loop is given: none (pad 0, no EOS) or the model's, as a run "
                             "gives them (each measured in turn, on a fresh copy of the model)")
    on_off(parser, "--release-cache", "off", "the KV cache given back after each rollout and mapped again before the "
           "next, as a GPU run's replica does (`rollout.release_kv_cache`), the mapping timed with the rollout; or "
           "held (off, the default); each measured in turn, on a fresh copy of the model")
    on_off(parser, "--compile-prefill", "on", "the prefill's decoder layers compiled (GraphDecoder's compile_prefill, "
           "on where the decode step is compiled, the default) or run eagerly; each measured in turn, on a fresh copy "
           "of the model")
    parser.add_argument("--beside", nargs="+", default=["none"], choices=BESIDE,
                        help="what the process holds beside the loop, as a run's actor does, built up in the order "
                             "given and kept (every variant measured at each): none; dist: a process group of one "
                             "rank, as DeepSpeed starts one (NCCL on a GPU); engine: also a ZeRO-2 DeepSpeed engine "
                             "over a copy of the model built as the actor builds it (fused ops, activation "
                             "checkpointing, on a GPU its decoder layers compiled within an activation budget of "
                             "0.05), after two optimizer steps of --train-micro sequences of --train-len tokens; "
                             "eager-engine: the same with its layers not compiled; compiled: the copy's layers "
                             "compiled as engine's (on a GPU) and trained two steps by torch's AdamW alone, no "
                             "DeepSpeed. Each at most once, in that order, with one of engine, eager-engine and "
                             "compiled at most. Dynamo is reset between variants: a held model's compiled layers keep "
                             "their code only through the first variant measured beside them")
    parser.add_argument("--train-micro", type=int, default=32, help="with --beside engine, eager-engine or compiled: "
                                                                       "sequences a micro-batch")
    parser.add_argument("--train-len", type=int, default=704, help="with --beside engine, eager-engine or compiled: "
                                                                    "tokens a sequence")
    parser.add_argument("--gaps", action="store_true",
                        help="with each profile, where the GPU idles between kernels: the idle time by gap length, "
                             "and the longest gaps, each with the device op it followed and the host's operator as it "
                             "began")
    args = parser.parse_args()
    held_models = [b for b in args.beside if b in ("engine", "eager-engine", "compiled")]
    if [BESIDE.index(b) for b in args.beside] != sorted({BESIDE.index(b) for b in args.beside}) or len(held_models) > 1:
        parser.error(f"--beside {' '.join(args.beside)}: each at most once, in the order {', '.join(BESIDE[:2])}, then "
                     "one of engine, eager-engine, compiled (each is built on what came before it, and kept)")
    if "on" in args.pdl and not inductor_has_pdl():
        parser.error(f"--pdl on: torch {torch.__version__}'s Inductor has no `triton.enable_pdl`")
    if min(args.steps_per_graph) < 1:
        parser.error(f"--steps-per-graph: decode steps a CUDA graph, at least 1, got {args.steps_per_graph}")
    if args.data and any(b % args.n for b in args.batch):
        parser.error(f"--data: every --batch must be a multiple of --n {args.n} (prompts x samples), got {args.batch}")

    from transformers import AutoModelForCausalLM

    from zbench.engine import decode_attention
    from zbench.engine.batches import PROMPT_WIDTH_MULTIPLE, aligned
    from zbench.engine.rollout import GraphDecoder, response_mask_from
    from zbench.models import resolve_model, special_ids

    on_cuda = torch.cuda.is_available()  # on a CPU the same loop runs eagerly (a check of this script, not a number)
    device = torch.device("cuda" if on_cuda else "cpu")
    sync = torch.cuda.synchronize if on_cuda else lambda: None
    path = resolve_model(args.model)
    stops = {"none": (0, []), "model": special_ids(path)}  # (pad id, EOS ids) given to the loop
    # kept on the CPU: each variant decodes with a copy of its own on the device, freed before the next
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if on_cuda else torch.float32).eval()
    base = {"model": args.model, "new_tokens": args.new_tokens, "top_p": args.top_p, "sync_every": args.sync_every,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu"}

    def prompts(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's left-padded prompts on the device: a step's GSM8K prompts (--data), padded to `width` rounded
        up to the trainer's bucket multiple, as the replica pads them with the Triton attention (0: to the next
        multiple, as the trainer pads them), or random tokens `width` wide."""
        if args.data:
            step = argparse.Namespace(model=args.model, data=args.data, prompts=batch // args.n, n=args.n,
                                      new_tokens=args.new_tokens)
            _, _, ids, mask, pad_id, _ = step_prompts(step)
            pad = max(aligned(ids.shape[1], PROMPT_WIDTH_MULTIPLE), aligned(width, PROMPT_WIDTH_MULTIPLE)) - ids.shape[1]
            return (torch.nn.functional.pad(ids, (pad, 0), value=pad_id).to(device),
                    torch.nn.functional.pad(mask, (pad, 0)).to(device))
        torch.manual_seed(0)
        ids = torch.randint(10, min(5000, lm.config.vocab_size), (batch, width), device=device)
        mask = torch.ones_like(ids)
        mask[: batch // 2, : width // 4] = 0  # half the rows left-padded, as a bucketed prompt batch is
        return ids, mask

    # built once, then every attention decodes the same prompts
    batches = [prompts(b, w) for b in args.batch for w in (args.prompt_width if args.data else args.width)]
    held: list[Any] = []  # what --beside built, kept alive
    for beside, attention, merge, sampler, share, mode, dense, one_grid, pdl, chained, stop, release, prefill in (
            itertools.product(args.beside, args.attention, args.merge, args.sampler, args.share, args.compile_mode,
                              args.dense, args.one_grid, args.pdl, args.steps_per_graph, args.stop,
                              args.release_cache, args.compile_prefill)):
        hold(beside, lm, device, held, args.train_micro, args.train_len)
        samples = args.n if args.data and share == "on" else 1
        joined = attention == "triton" and samples > 1  # else no shared prefix: nothing for ONE_GRID to join
        if not joined and one_grid != args.one_grid[0]:  # so one run, labelled None
            continue
        decode_attention.DENSE = dense == "on"  # read when the step is recorded
        decode_attention.ONE_GRID = one_grid == "on"
        decode_attention.PDL = pdl == "on"  # GraphDecoder compiles Inductor's kernels of the step the same way
        graph = GraphDecoder(copy.deepcopy(lm).to(device), compile=on_cuda, sync_every=args.sync_every,
                             attention=attention, merge=merge == "on", sample_in_graph=sampler == "graph",
                             compile_mode=mode, steps_per_graph=chained, release_cache=release == "on",
                             compile_prefill=on_cuda and prefill == "on")
        prefill_s = time_prefill(graph, sync)
        pad_id, eos_ids = stops[stop]
        for ids, mask in batches:
            batch, width = ids.shape

            longest = [args.new_tokens]  # the last rollout's longest response: the tokens it decoded

            def rollout(seed: int, ids: torch.Tensor = ids, mask: torch.Tensor = mask,
                        graph: GraphDecoder = graph, samples: int = samples,
                        stopped: tuple[int, list[int]] = stops[stop], longest: list[int] = longest) -> float:
                sync()
                start = time.perf_counter()
                out = graph.generate(ids, mask, max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p,
                                     pad_id=stopped[0], eos_ids=stopped[1],
                                     generator=torch.Generator(device).manual_seed(seed), samples=samples)
                sync()
                seconds = time.perf_counter() - start
                if graph.release_cache:  # as the replica gives it back before training; `generate` maps it again
                    graph.free_cache()
                longest[0] = int(response_mask_from(out, stopped[1], stopped[0]).sum(-1).max())
                return seconds

            if on_cuda:  # the peak from here on: an earlier width of this variant still holds its recording's pool
                torch.cuda.reset_peak_memory_stats()
            first = rollout(0)
            prefill_s.clear()
            times = [rollout(1 + i) for i in range(args.repeats)]
            prefills = sorted(prefill_s)
            row = base | {"attention": attention, "compile_mode": mode, "merged_projections": graph.merged_projections,
                          "sampler": "graph" if graph.sample_in_graph else "eager", "batch": batch,
                          "shared_rows": graph.shared_prefix[0],
                          "dense": dense if attention == "triton" else None,
                          # as they ran: ONE_GRID where the prefill shared the prompts, PDL where it applies
                          "one_grid": one_grid if graph.shared_prefix[0] > 1 else None, "pdl": pdl,
                          "decode_kernels": graph.decode_kernels, "steps_per_graph": graph.steps_a_graph(args.top_p),
                          "width": width, "data": args.data or "random", "prompt_tokens": int(mask.sum()),
                          "stop": stop, "eos_ids": eos_ids, "pad_id": pad_id,
                          # as it ran: given back where the device can (else held, with a warning)
                          "release_cache": graph.release_cache, "beside": beside,
                          "prefill_compiled": graph.prefill_compiled}
            reserved = torch.cuda.max_memory_reserved() / 2**30 if on_cuda else None
            print(json.dumps(row | {"what": "generate", "first_s": first, "median_s": statistics.median(times),
                                    "min_s": min(times), "max_s": max(times), "max_memory_reserved_gb": reserved,
                                    "prefill_median_s": statistics.median(prefills) if prefills else None,
                                    "prefill_max_s": prefills[-1] if prefills else None}),
                  flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                wall = rollout(99)
            kernel_s, top, host = kernel_table(prof, args.top)
            extra = {"gaps": idle_gaps(prof)} if args.gaps else {}
            print(json.dumps(row | {"what": "profile", "wall_s": wall, "kernel_s": kernel_s, "gpu_busy": kernel_s / wall,
                                    "tokens": longest[0], "kernel_ms_per_token": 1e3 * kernel_s / longest[0],
                                    "top": top, "host_top": host} | extra),
                  flush=True)
        # the next variant starts clean: its own compilations (dynamo's recompile limit counts per code object,
        # which every GraphDecoder shares) and none of this one's memory
        del graph, rollout
        torch._dynamo.reset()
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()


BESIDE = ("none", "dist", "engine", "eager-engine", "compiled")


def time_prefill(graph: Any, sync: Any) -> list[float]:
    """Time each prefill `graph` runs from now on (synchronised before and after, so it adds one wait to its rollout,
    which the loop's own first token needs anyway): the seconds go into the list returned."""
    seconds: list[float] = []
    run = graph._prefill

    def timed(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        out = run(*args, **kwargs)
        sync()
        seconds.append(time.perf_counter() - start)
        return out

    graph._prefill = timed
    return seconds


def hold(what: str, lm: Any, device: torch.device, held: list[Any], micro: int, length: int) -> None:
    """Build what `--beside` names beside the loop, once, keeping it in `held`: `dist` a process group of one rank;
    `engine` (after the group) a trained ZeRO-2 DeepSpeed engine over a copy of `lm`, built as the actor builds its
    model (`zbench.engine.workers`), `eager-engine` the same with eager layers; `compiled` the copy's compiled layers
    trained by torch alone. Nothing is built where `held` already holds a model."""
    import torch.distributed as dist

    if what in ("dist", "engine", "eager-engine") and not dist.is_initialized():
        from zbench.engine.cluster import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port("127.0.0.1")))
        if device.type != "cuda":
            os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones)  # the communicator exists from here on, as after a run's first collective
    if what == "compiled" and not held:  # the compiled layers trained by torch alone
        model = _training_copy(lm, device, compiled=True).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for _ in range(2):
            ids = torch.randint(0, lm.config.vocab_size, (micro, length), device=device)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
        held.append((model, opt))
    if what in ("engine", "eager-engine") and not held:
        import deepspeed

        from zbench.bench import bare_steps
        from zbench.config import ZeroConfig, effective_offload
        from zbench.engine.ds_config import training_config

        on_cuda = device.type == "cuda"
        config = training_config(ZeroConfig(stage=2), effective_offload(2, "none"), micro_batch=micro, grad_accum=1,
                                 world_size=1, lr=1e-6, weight_decay=0.0, grad_clip=1.0, bf16=on_cuda,
                                 on_cuda=on_cuda, nvme_path="")
        model = _training_copy(lm, device, compiled=what == "engine")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        seconds = bare_steps(engine, "lm", micro, length, 1, 2, torch.Generator().manual_seed(0))
        print(json.dumps({"what": what, "micro": micro, "length": length, "step_s": seconds}), flush=True)
        held.append(engine)


def _training_copy(lm: Any, device: torch.device, compiled: bool) -> Any:
    """A copy of `lm` set up as the actor sets up its model: fused ops, activation checkpointing, and with `compiled`
    on CUDA (where the actor compiles them) its decoder layers compiled within an activation budget of 0.05."""
    from zbench.engine.fused import fuse
    from zbench.engine.workers import budgeted_backend

    model = copy.deepcopy(lm)
    fuse(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if compiled and device.type == "cuda":
        for layer in model.model.layers:
            layer.compile(dynamic=True, backend=budgeted_backend("inductor", 0.05))
    return model


def idle_gaps(prof: torch.profiler.profile, longest: int = 12) -> dict[str, object]:
    """Where the GPU idled between the profiled rollout's first and last device op: idle seconds and gap counts by gap
    length (`zbench.engine.profiling.IDLE_EDGES_NS`), and the `longest` gaps (microseconds) with the device op each
    followed and the host's operator as it began, which tells a host that cannot keep up every step (many small
    gaps) from a few stalls (a sync, the prefill's launches); and the gaps of 10 us or more summed by the host's
    stack as each began (`waits_ms`: stack, gaps, ms)."""
    timeline = DeviceTimeline(list(prof.profiler.kineto_results.events()))
    if not timeline.ops:  # a CPU run records no device ops
        return {"kernels": 0}
    start, end = timeline.span
    idle = timeline.idle(start, end, None, listed=longest)
    return {"kernels": len(timeline.ops), "span_s": (end - start) / 1e9,
            "by_size": {name: {"gaps": n, "idle_s": round(ms / 1e3, 4)}
                        for name, (n, ms) in zip(idle_class_names(), idle.classes, strict=True)},
            "longest_us": [[round(g.length_us, 1), g.after[:60], g.host[:60]] for g in idle.longest],
            "waits_ms": [[w.host, w.gaps, round(w.ms, 2)] for w in idle.waits]}


if __name__ == "__main__":
    main()
