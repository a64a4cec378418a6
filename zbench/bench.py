"""Floors to measure the engine against, on the same machine and model: bare DeepSpeed training on the tokens
an RL step trains on, and bare Hugging Face `generate`.

    zbench bench floor --model qwen3-0.6b --stage 1 --stage 2 --stage 3 --offload none --offload cpu \
        --seqs 32 --seq-len 612 --micro 8 --world-size 2
    zbench bench floor --like results/<run root>     # the floors of that run's cases, into <run root>/floors.jsonl
    zbench bench gen --model qwen3-0.6b --prompts 64 --new-tokens 512 --decode graph

`floor` spawns one process per rank (NCCL on CUDA, gloo on CPU), builds a DeepSpeed engine exactly as the
engine's actor does (same config builder), and times forward + backward + optimizer steps over random tokens:
the update phase of an RL step cannot be much faster than this. `--head value` measures the critic's model (the
same backbone with a one-output token head, as the critic builds it) instead of the actor's causal LM. Several
heads, stages and offloads are measured one after another in the same processes, so the start-up is paid once.
Each rank gets its share of the host's cores as CPU threads, as the engine's GPU ranks do.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class FloorSpec:
    """One bare-DeepSpeed measurement."""

    model: str = "tiny"
    stage: int = 2
    offload: str = "none"
    seqs: int = 32  # sequences per rank per optimizer step (an RL mini-batch's share of one rank)
    seq_len: int = 612  # prompt + response tokens
    micro: int = 8  # micro-batch per rank; grad accumulation = seqs / micro
    world_size: int = 1
    steps: int = 5  # timed optimizer steps, after `warmup`
    warmup: int = 2
    gradient_checkpointing: bool = False
    checkpoint_layers: int | None = None  # with checkpointing: the first N decoder layers only (`model.checkpoint_layers`)
    fused_ops: bool = True  # the engine's lean RMSNorm and SwiGLU (`model.fused_ops`)
    head: str = "lm"  # lm: the actor's causal LM and loss; value: the critic's one-output token head, squared loss
    coalesce: bool = False  # DeepSpeed's coalesced gradient reduction, as a case asks (`zero.coalesce_grad_reduction`)
    # the step's gradient checks fused where they apply, as a case asks (`zero.fused_grad_checks`); off: DeepSpeed's
    fused_grad_checks: bool = False
    # measured at a smaller micro-batch in place of this one, which ran out of memory (`halved`); None: as asked
    asked_micro: int | None = None


HEADS = ("lm", "value")


def _floor_rank(rank: int, specs: list[FloorSpec], port: int, out: str) -> None:
    world_size = specs[0].world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch.distributed as dist

    from zbench.engine import build_lock, cpu_info
    from zbench.engine.ds_config import import_deepspeed

    deepspeed = import_deepspeed()  # as a worker imports it

    build_lock.install()  # a build lock left by a killed rank must not hang this one
    cpu_info.install()
    if on_cuda:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", verbose=False)
    for spec in specs:  # one after another in the same processes: start-up is paid once
        result = _measure(rank, spec, on_cuda)
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(result) + "\n")
        dist.barrier()
    dist.destroy_process_group()


def bare_steps(engine: Any, head: str, micro: int, seq_len: int, accum: int, steps: int,
               generator: torch.Generator, coalesce: bool = False) -> list[float]:
    """Seconds of each of `steps` optimizer steps of a DeepSpeed `engine` over random tokens, `accum` micro-batches
    of `micro` x `seq_len` each: the LM loss for head `lm`, a squared value-head output for `value`; with `coalesce`,
    the gradients reduced once a step (`zbench.engine.ds_config.accumulated_step`). Nothing else runs: no mask, no
    log-prob or RL loss, no statistics."""
    from zbench.engine.ds_config import accumulated_step

    on_cuda = torch.device(engine.device).type == "cuda"
    vocab = engine.module.config.vocab_size

    def loss() -> torch.Tensor:
        ids = torch.randint(0, vocab, (micro, seq_len), generator=generator).to(engine.device)
        if head == "value":
            return engine(input_ids=ids, use_cache=False).logits.float().square().mean()
        return engine(input_ids=ids, labels=ids, use_cache=False).loss

    times = []
    for _ in range(steps):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        accumulated_step(engine, (loss() for _ in range(accum)), coalesce)
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _release_zero3_globals() -> None:
    """DeepSpeed 0.19 keeps a ZeRO-3 engine alive after `destroy()` through two process-wide references: the
    forward module stack and an unbounded `lru_cache` on the parameter coordinator (keyed by the modules, whose
    parameters reference the optimizer). Clear both so the next floor starts from an empty device."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator as Coordinator,
    )

    parameter_offload.FWD_MODULE_STACK.clear()
    wrapper = Coordinator.__dict__.get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(wrapper, "__closure__", None) or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def _measure(rank: int, spec: FloorSpec, on_cuda: bool) -> dict[str, Any]:
    """Build a DeepSpeed engine as the actor does, time `spec.steps` optimizer steps after `spec.warmup`, then
    free everything it held (`memory_held_at_start_gb` shows what an earlier floor may have left behind)."""
    import gc

    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from zbench.config import ZeroConfig, effective_offload
    from zbench.engine.ds_config import training_config
    from zbench.engine.grad_checks import fuse_grad_checks
    from zbench.models import resolve_model

    zero = ZeroConfig(stage=spec.stage, offload=spec.offload)
    offload = effective_offload(spec.stage, spec.offload)
    accum = spec.seqs // spec.micro
    cfg = training_config(zero, offload, micro_batch=spec.micro, grad_accum=accum, world_size=spec.world_size,
                          lr=1e-5, weight_decay=0.0, grad_clip=1.0, bf16=on_cuda, on_cuda=on_cuda,
                          nvme_path=str(Path(tempfile.gettempdir()) / "zbench-floor-nvme"))
    dtype = torch.bfloat16 if on_cuda else torch.float32
    held = torch.cuda.memory_allocated() / 2**30 if on_cuda else None
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    path = resolve_model(spec.model)
    if spec.head == "value":  # built as the critic builds it
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(path, dtype=dtype, config=config)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if spec.fused_ops:
        from zbench.engine.fused import fuse

        fuse(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.checkpoint_layers is not None:  # the layers past the first N keep their activations, as the case's
            for layer in model.base_model.layers[spec.checkpoint_layers:]:
                layer.gradient_checkpointing = False
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    grad_checks = fuse_grad_checks(engine) if spec.fused_grad_checks else "deepspeed (off)"
    times = bare_steps(engine, spec.head, spec.micro, spec.seq_len, accum, spec.warmup + spec.steps,
                       torch.Generator().manual_seed(rank), spec.coalesce)[spec.warmup:]
    step = statistics.median(times)
    result = {**asdict(spec), "model_class": type(model).__name__, "grad_checks": grad_checks,
              "step_s_median": step, "step_s_all": times,
              "tokens_per_s_per_gpu": spec.seqs * spec.seq_len / step,
              "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
              "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else None,
              "memory_held_at_start_gb": held, "cpu_threads": torch.get_num_threads(),
              "device": torch.cuda.get_device_name() if on_cuda else "cpu"}
    engine.destroy()
    del engine, model
    _release_zero3_globals()
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return result


class FloorError(RuntimeError):
    """A floor failed; `done` holds the results of the floors measured before it."""

    def __init__(self, message: str, done: list[dict[str, Any]]):
        super().__init__(message)
        self.done = done


def halved(spec: FloorSpec) -> FloorSpec | None:
    """The floor to measure in place of `spec` once it ran out of memory: the same sequences per optimizer step in
    micro-batches of at most half the size (the largest that divides them), so twice the accumulation or more, noting
    the micro-batch first asked; None at a micro-batch of 1."""
    micro = next((m for m in range(spec.micro // 2, 0, -1) if spec.seqs % m == 0), None)
    if micro is None:
        return None
    return replace(spec, micro=micro, asked_micro=spec.asked_micro or spec.micro)


def floors(specs: list[FloorSpec], halve_on_oom: bool = True) -> list[dict[str, Any]]:
    """Median optimizer-step time of bare DeepSpeed and tokens per second per GPU, for each spec in turn, in one
    set of rank processes (they must share the model and world size). A floor that runs out of memory is a result
    (`oom_record`: bare DeepSpeed cannot train that shape here), and the floors after it are measured in fresh
    processes; with `halve_on_oom`, first the same floor again at a micro-batch of at most half (`halved`), down to
    1, each attempt recorded, since a floor's micro-batch is the case's and bare DeepSpeed's head forms the whole
    micro-batch's logits in float32 where the engine's never does (ZeRO-3's micro-batch 64 of Qwen3-0.6B: 24.8 GiB).
    A floor that ran out of memory after others in the same processes is measured again in fresh ones before it
    counts (what the others left behind may have been the cause). Any other failure raises `FloorError`, which
    carries the results measured before it."""
    from zbench.config import ZeroConfig
    from zbench.engine.cluster import cpu_threads_per_rank

    if not specs:
        raise ValueError("no floor to measure")
    for spec in specs:
        ZeroConfig(stage=spec.stage, offload=spec.offload)  # a bad stage or offload is refused before any start
        if spec.seqs % spec.micro:
            raise ValueError(f"seqs={spec.seqs} must be a multiple of micro={spec.micro}")
        if spec.head not in HEADS:
            raise ValueError(f"head={spec.head!r}: expected one of {', '.join(HEADS)}")
        if (spec.model, spec.world_size) != (specs[0].model, specs[0].world_size):
            raise ValueError("floors measured together must share the model and the world size")
    # each rank gets its share of the host's cores, as the engine's GPU ranks do (CPU Adam runs on them)
    ranks = specs[0].world_size
    threads = cpu_threads_per_rank(min(ranks, torch.cuda.device_count()) if torch.cuda.is_available() else ranks)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the spawned ranks as they start
    try:
        queue = list(specs)  # grows by the halved floors
        asked = list(range(len(specs)))  # the index in `specs` of each floor of the queue
        results: list[dict[str, Any]] = []
        while len(results) < len(queue):
            try:
                results += _spawn_floors(queue[len(results):])
            except _RanksFailed as err:
                results += err.done
                if len(results) == len(queue):  # every floor finished: the ranks failed as they closed
                    raise FloorError(f"the ranks failed after the last floor: {err.reason}", results) from err
                spec = queue[len(results)]
                where = (f"floor {asked[len(results)] + 1} of {len(specs)} (stage {spec.stage}, offload "
                         f"{spec.offload}, head {spec.head}, micro {spec.micro})")
                if not err.oom:
                    raise FloorError(f"{where} failed: {err.reason}", results) from err
                if err.done:  # not the first in its processes: again in fresh ones, first
                    continue
                results.append(oom_record(spec, err.reason))
                smaller = halved(spec) if halve_on_oom else None
                if smaller is not None:
                    queue.insert(len(results), smaller)
                    asked.insert(len(results), asked[len(results) - 1])
        return results
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


class _RanksFailed(RuntimeError):
    """The rank processes of `_spawn_floors` stopped early: `done` holds the floors they finished, `reason` the
    failure's last line, `oom` whether it was running out of memory."""

    def __init__(self, reason: str, done: list[dict[str, Any]], oom: bool):
        super().__init__(reason)
        self.reason, self.done, self.oom = reason, done, oom


def oom_record(spec: FloorSpec, reason: str) -> dict[str, Any]:
    """The floors.jsonl record of a floor that ran out of memory: its shape, `status: oom` and the error's line,
    no times (a reader sets nothing against it). Made in the parent, which never initialises CUDA (the ranks
    after it would start beside its context), so the device is the run root's manifest's to say."""
    return {**asdict(spec), "status": "oom", "error": reason}


def _spawn_floors(specs: list[FloorSpec]) -> list[dict[str, Any]]:
    """Run the floors in `world_size` spawned rank processes. SIGINT (^C, or `timeout -s INT` bounding the floors)
    stops them even where the command started with SIGINT ignored, as a background job does: the ranks are
    terminated and the floors they finished are kept (`_RanksFailed.done`)."""
    import signal

    import torch.multiprocessing as mp

    from zbench.engine.cluster import free_port
    from zbench.procs import OOM_PATTERNS

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floors.jsonl"

        def done() -> list[dict[str, Any]]:
            return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        ranks = None
        try:
            ranks = mp.spawn(_floor_rank, args=(specs, free_port(), str(out)), nprocs=specs[0].world_size,
                             join=False)
            while not ranks.join():  # False while ranks remain after one exits cleanly; raises if one failed
                continue
        except (Exception, KeyboardInterrupt) as err:  # a rank raised or died, or SIGINT: keep what was measured
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second ^C must not cut the cleanup short
            for proc in ranks.processes if ranks is not None else []:
                if proc.is_alive():
                    proc.terminate()
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if isinstance(err, KeyboardInterrupt):
                raise _RanksFailed("interrupted", done(), oom=False) from err
            text = str(err).strip()  # a rank's exception comes with its traceback's text: its last line says what
            last = text.splitlines()[-1].strip() if text else type(err).__name__
            raise _RanksFailed(last, done(), oom=bool(OOM_PATTERNS.search(last))) from err
        finally:
            signal.signal(signal.SIGINT, previous)
        return done()


def specs_like(run_root: Path, steps: int, warmup: int) -> tuple[list[FloorSpec], list[str]]:
    """The floors a run's training phases are set against, read from its cases: model, ranks, ZeRO stage and
    offload, training micro-batch, sequences per rank per optimizer step, and the mean sequence length the case
    trained on (prompt + response, steps 2.. of its metrics); the value head too for PPO's critic. Each distinct
    floor once. Also returns a note for every case left out (no config, or no step recorded).

    Bare DeepSpeed's layers keep all of their activations or, checkpointed, only their input: a case whose compiled
    layers keep a share below 1 (`model.activation_memory_budget`) is set against every layer checkpointed, the
    floor at its memory (a budget of 0 keeps what checkpointing keeps), not against one that keeps everything."""
    from zbench.config import ConfigError, load_case_config
    from zbench.runroot import casedir
    from zbench.runroot.root import MANIFEST
    from zbench.runroot.summary import steady_records

    run_root = Path(run_root)
    if not (run_root / MANIFEST).is_file():
        raise ValueError(f"--like {run_root}: not a run root (no {MANIFEST})")
    specs: list[FloorSpec] = []
    notes: list[str] = []
    for cdir in sorted(p for p in run_root.iterdir() if (p / casedir.CONFIG).is_file()):
        try:
            cfg = load_case_config(cdir / casedir.CONFIG)
        except ConfigError as err:
            notes.append(f"{cdir.name}: left out: {err}")
            continue
        lengths = [r["prompt_length/mean"] + r["response_length/mean"]
                   for r in steady_records(casedir.read_metrics(cdir).records)
                   if "prompt_length/mean" in r and "response_length/mean" in r]
        if not lengths:
            notes.append(f"{cdir.name}: left out: no step recorded")
            continue
        seq_len = round(sum(lengths) / len(lengths))
        seqs, heads = cfg.floor_shape()
        budgeted = cfg.model.activation_memory_budget < 1.0  # only compiled layers run below 1
        for head, micro in heads.items():
            spec = FloorSpec(model=cfg.model.path, stage=cfg.zero.stage, offload=cfg.zero.offload, seqs=seqs,
                             seq_len=seq_len, micro=micro, world_size=cfg.trainer.world_size, steps=steps,
                             warmup=warmup,
                             gradient_checkpointing=cfg.model.gradient_checkpointing or budgeted,
                             checkpoint_layers=None if budgeted else cfg.model.checkpoint_layers,
                             fused_ops=cfg.model.fused_ops, head=head,
                             coalesce=cfg.zero.coalesce_grad_reduction,
                             fused_grad_checks=cfg.zero.fused_grad_checks)
            if spec not in specs:
                specs.append(spec)
    if not specs:
        raise ValueError(f"--like {run_root}: no case with a recorded step" + "".join(f"; {n}" for n in notes))
    return specs, notes


DECODES = ("generate", "static", "graph")


def generation(model: str, prompts: int, prompt_len: int, new_tokens: int, decode: str,
               repeats: int = 2) -> dict[str, Any]:
    """Generated tokens per second (sampling at temperature 1, forced to `new_tokens`), best of `repeats` after a
    warm-up call, for transformers `generate` with a dynamic (`generate`) or static (`static`) cache, or zbench's
    CUDA-graph decode loop (`graph`, with the attention `rollout.decode_attention=auto` gives: Triton's kernels on a
    CUDA device, else SDPA). For `graph`, also how far its greedy tokens agree with `generate`'s."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from zbench.engine.rollout import GraphDecoder, resolve_decode_attention
    from zbench.models import resolve_model, special_ids

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    path = resolve_model(model)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    ids = torch.randint(10, 200, (prompts, prompt_len), device=device)
    mask = torch.ones_like(ids)
    attention = resolve_decode_attention("auto", device, lm.config, dtype) if decode == "graph" else None
    graph = GraphDecoder(lm, compile=on_cuda, attention=attention) if attention else None

    def hf(sample: bool, tokens: int) -> torch.Tensor:
        gen = GenerationConfig(do_sample=sample, temperature=1.0 if sample else None, top_p=1.0 if sample else None,
                               top_k=0 if sample else None, max_new_tokens=tokens, min_new_tokens=tokens,
                               pad_token_id=0, eos_token_id=None,
                               cache_implementation="static" if decode == "static" else None)
        return lm.generate(input_ids=ids, attention_mask=mask, generation_config=gen)[:, prompt_len:]

    def run(sample: bool, tokens: int) -> torch.Tensor:
        if graph is None:
            return hf(sample, tokens)
        return graph.generate(ids, mask, max_new_tokens=tokens, temperature=1.0 if sample else 0.0, top_p=1.0,
                              pad_id=0, eos_ids=[], generator=torch.Generator(device).manual_seed(0))

    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call compiles / warms up
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(True, new_tokens)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result: dict[str, Any] = {"max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else None}
        if graph is not None:  # greedy agreement with plain generate over the first 32 tokens, both stopping at EOS
            pad_id, eos_ids = special_ids(path)
            ours = graph.generate(ids, mask, max_new_tokens=32, temperature=0.0, top_p=1.0, pad_id=pad_id,
                                  eos_ids=eos_ids, generator=None)
            greedy = GenerationConfig(do_sample=False, max_new_tokens=32, pad_token_id=pad_id, eos_token_id=eos_ids)
            lm.set_attn_implementation("sdpa")  # the decoder switched the model to its own attention: compare to stock
            theirs = lm.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)[:, prompt_len:]
            theirs = torch.cat([theirs, theirs.new_full((prompts, 32 - theirs.shape[1]), pad_id)], dim=1)
            same = (ours == theirs).long().cumprod(dim=1).sum(dim=1).float()
            result |= {"greedy_common_prefix_mean": same.mean().item(), "greedy_identical_rows": int((same == 32).sum())}
    best = min(times[1:])
    return {"model": model, "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "decode": decode, **({"decode_attention": attention} if attention else {}),
            "cold_s": times[0], "best_s": best, "generated_tokens_per_s": prompts * new_tokens / best,
            **result,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu"}
