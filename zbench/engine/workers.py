"""Ray worker processes: one policy worker (actor + rollout + reference) and, for PPO, one critic worker per rank.

Workers move tensors and call the pure functions in `algos`; the controller (`trainer`) decides what runs when.
Each worker group forms its own torch.distributed group (NCCL on CUDA, gloo on CPU) from an address and port
picked by its rank-0 worker, so the actor and critic groups, and concurrent cases, never collide.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from zbench.config import ConfigError, RunConfig, auto_takes_graph_loop, effective_offload, replica_parks
from zbench.engine import algos, build_lock, cpu_info, lm_head
from zbench.engine.batches import (
    Batch,
    forward_batches,
    forward_micro,
    in_row_order,
    length_order,
    micro_batches,
    token_share_denominator,
)
from zbench.engine.cluster import free_port, join_process_group
from zbench.engine.ds_config import accumulated_step, import_deepspeed
from zbench.engine.heap import GcClock, freeze_survivors, release_dropped
from zbench.engine.profiling import PhaseProfile, StepProfiler, phase_rows
from zbench.engine.profiling import part as phase_part  # `part` names a local helper below
from zbench.engine.records import gpu_memory_in_use_gb
from zbench.models import special_ids
from zbench.procs import CARRIED_WARNING, PROCESS_DIR_ENV
from zbench.stacks import enable_stack_dumps


def response_decoder(model: Any) -> torch.nn.Module:
    """The module whose output (`last_hidden_state`) the head of `model` (a Hugging Face model, or a DeepSpeed
    engine around one) reads: the model's decoder (`get_decoder()`: `model.model` for Llama-style models, the
    decoder stack for OPT, whose head skips the base model's own forward). A model without a separate one cannot
    run the maskless layout: a config error naming `model.maskless_attention`."""
    module = getattr(model, "module", model)  # DeepSpeed's engine holds the Hugging Face model as .module
    decoder = module.get_decoder() if hasattr(module, "get_decoder") else None
    if not isinstance(decoder, torch.nn.Module) or decoder is module:
        raise ConfigError("model.maskless_attention", f"{type(module).__name__} has no decoder module apart from its "
                                                      "head for the maskless layout to read; set it to false")
    return decoder


def skip_zero3_param_ids(guards: Any) -> list[bool]:
    """A `torch.compile` guard filter that keeps every guard except those on a ZeRO-3 parameter's `ds_id`.

    DeepSpeed numbers each partitioned parameter (`ds_id`), and Dynamo, tracing the backward of ZeRO-3's linear
    function (which asks whether its weight is a ZeRO parameter), guards on that number. Every decoder layer's
    parameters have other numbers, so without this filter each layer compiles a graph of its own until Dynamo's
    recompile limit, and the layers past it run eager. The number is an identity and never enters the
    computation; the guards on the tensors' shapes, dtypes and the parameters' gather status stay."""
    return [not entry.name.endswith(".ds_id") for entry in guards]


class BudgetedBackend:
    """A `torch.compile` backend that compiles as `backend` does, partitioning each training graph's saved
    activations within `budget` (`model.activation_memory_budget`): the compiler recomputes in the backward what it
    does not keep, choosing the cheapest recomputation that fits.

    The budget travels with the backend, not in the process's compiler settings: Dynamo reuses a graph compiled for
    the same code under any setting, so a tune trial with another budget would run the last trial's graphs. Another
    backend object is one of Dynamo's guards, so each budget compiles its own (one object a budget and named
    backend: `budgeted_backend`)."""

    def __init__(self, backend: Any, budget: float):
        self.name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.budget = budget

    def __repr__(self) -> str:
        return f"BudgetedBackend({self.name}, activation_memory_budget={self.budget:g})"

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.backend(graph, example_inputs)


def budgeted_backend(backend: Any, budget: float) -> BudgetedBackend:
    """`backend` (a registered backend's name, or a compiler function) within `budget`. For a name, the one such
    object of this process, so a trial that asks what an earlier one asked reuses its graphs instead of compiling
    them again; a function is wrapped anew each time (it may be unhashable, and the cache would keep it alive)."""
    return _named_budgeted_backend(backend, budget) if isinstance(backend, str) else BudgetedBackend(backend, budget)


@functools.cache
def _named_budgeted_backend(backend: str, budget: float) -> BudgetedBackend:
    return BudgetedBackend(backend, budget)


# weak references to the models (and their optimizers) this process released, for as long as any of them lives on
_RELEASED: list[weakref.ref] = []


def _parameter_bytes(obj: Any) -> int:
    """Bytes of a module's parameters as this process holds them (a ZeRO-3 parameter's partition, else the whole);
    0 for anything else (an optimizer)."""
    if not isinstance(obj, torch.nn.Module):
        return 0
    held = 0
    for p in obj.parameters():
        part = getattr(p, "ds_tensor", None)
        t = p if part is None else part
        held += t.numel() * t.element_size()
    return held


def carried_objects() -> list[Any]:
    """The models and optimizers this process released (`_Worker.release`) that something still holds."""
    _RELEASED[:] = [r for r in _RELEASED if r() is not None]
    return [m for r in _RELEASED if (m := r()) is not None]


def carried_report(role: str, rank: int, device: torch.device | None = None) -> str:
    """What this process still holds of the models it released, in words ("" when nothing): counted by kind, their
    parameters' size, and on a GPU the memory allocated in the process now (everything it holds, the live models'
    included), for `CARRIED_WARNING`."""
    carried = carried_objects()
    if not carried:
        return ""
    held = sum(_parameter_bytes(m) for m in carried)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(type(m).__name__ for m in carried).items()))
    allocated = (f", {torch.cuda.memory_allocated(device) / 2**30:.2f} GB allocated in the process after the release"
                 if device is not None and device.type == "cuda" else "")
    return f"{role} rank {rank}: {kinds}; {_size(held)} of parameters{allocated}"


def carried_line(reports: list[str]) -> str:
    """The warning line of a trial whose processes still hold models of earlier trials (`carried_report` of each
    rank that does), which the launcher makes the trial's warning (`zbench.harness.launch.carried_warning`)."""
    return f"[zbench] warning: {CARRIED_WARNING} ({'; '.join(reports)}); this trial's memory figures include them"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def _forget_zero3_module(module: torch.nn.Module) -> None:
    """ZeRO-3 keeps every engine's model reachable from module-level state that nothing clears: a stack of modules
    (`parameter_offload.FWD_MODULE_STACK`) and the parameter coordinator's memoized release sets, a class-level
    cache keyed by the model's submodules. An engine dropped in a process that goes on would keep its parameters'
    partitions and, through them (`_z3_optimizer`) and its backward hooks, its optimizer and gradients alive. Take
    the model and every one of its submodules off the stack and empty the caches (memos: the engines still alive
    compute theirs again).

    Submodules are left on the stack by activation checkpointing: the stack is pushed by each module's pre-forward
    hook and popped by its post-forward hook, and the backward's recomputation of a checkpointed layer stops at its
    last saved tensor (torch.utils.checkpoint's early stop, `use_reentrant=False`) by raising inside the forward, so
    the modules whose forward it was in are never popped: the decoder layer itself where transformers checkpoints
    the layer's call (5.17; ZeRO-3 leaf layers, `model.compile_layers`), its MLP and last projection where it
    checkpoints the layer's forward (5.24): one or two entries per recomputed layer and micro-batch, which pile up
    through a case (harmless while their engine lives) until its release. Each keeps, through its parameters, the
    whole engine alive."""
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        mine = {id(m) for m in module.modules()}
        stack[:] = [m for m in stack if id(m) not in mine]
    coordinator = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", None)
    for attr in vars(coordinator).values() if coordinator is not None else ():
        # the memo may sit inside a wrapper (DeepSpeed's NVTX instrumentation): look in its closure too
        inner = [cell.cell_contents for cell in getattr(attr, "__closure__", None) or () if _cell_full(cell)]
        for fn in (attr, *inner):
            if callable(getattr(fn, "cache_clear", None)):
                fn.cache_clear()


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def zero3_leaf_layers(model: torch.nn.Module, layers: torch.nn.ModuleList) -> int:
    """Mark each decoder layer a ZeRO-3 leaf module (before `deepspeed.initialize`): DeepSpeed then gathers a
    layer's parameters all at once in the layer's own hooks and installs none on its projections and norms. Returns
    the number of layers marked."""
    from deepspeed.utils import set_z3_leaf_modules

    marked = set_z3_leaf_modules(model, list({type(layer) for layer in layers}))
    return len(marked)


def on_response(x: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Per-token outputs [rows, R] with 0 after each response's end: what a layout computes there (padding, or in
    `shift_padding_right`'s the last kept column again) depends on the micro-batch, and nothing may read it."""
    return torch.where(mb["response_mask"].bool(), x, torch.zeros_like(x))


def model_outputs(model: Any, mb: Batch, **kwargs: Any) -> Any:
    """`model` (a Hugging Face model, or a DeepSpeed engine around one) on a micro-batch of `forward_batches`.

    A micro-batch laid out by `shift_padding_right` runs without mask or positions; a forward hook on the model's
    decoder (`response_decoder`) keeps its hidden states at `hidden_index` only, so the head (LM or value) sees the
    positions of the left-padded layout's last R + 1 columns, in that order, as the masked layout gives them. A
    forward that does not pass through that decoder exactly once is refused rather than scored on other columns."""
    if "hidden_index" not in mb:
        return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                     position_ids=mb["position_ids"], use_cache=False, **kwargs)
    decoder = response_decoder(model)
    index = mb["hidden_index"]
    calls = 0

    def keep_response_positions(_module: Any, _args: Any, out: Any) -> Any:
        nonlocal calls
        calls += 1
        hidden = out.last_hidden_state
        out.last_hidden_state = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        return out

    handle = decoder.register_forward_hook(keep_response_positions)
    try:
        out = model(input_ids=mb["input_ids"], use_cache=False, **kwargs)
    finally:
        handle.remove()
    if calls != 1:
        raise ConfigError("model.maskless_attention", f"a forward ran {type(decoder).__name__} {calls} times, not once: "
                                                      "its head does not read that module's output; set it to false")
    return out


def phase(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Label a worker method as phase `name` in a step profile (`trainer.profile_step`)."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def labelled(self: _Worker, *args: Any, **kwargs: Any) -> Any:
            with self.profiler.phase(name):
                return method(self, *args, **kwargs)
        return labelled
    return wrap


class _Worker:
    """What every worker does: join its process group, place itself on a device, report memory."""

    role = "worker"

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, case_dir: str, model_path: str):
        build_lock.install()  # a build lock left by a killed worker must not hang this one (see the module)
        cpu_info.install()  # DeepSpeed's op loads probe the CPU once per boot, not twice per worker
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.case_dir = Path(case_dir)
        # a hung case prints where this worker is before it is killed
        enable_stack_dumps(os.environ.get(PROCESS_DIR_ENV) or self.case_dir)
        self.model_path = model_path
        self.offload = effective_offload(self.cfg.zero.stage, self.cfg.zero.offload)
        self.on_cuda = self.cfg.trainer.uses_cuda()
        self.device = torch.device("cuda", 0) if self.on_cuda else torch.device("cpu")
        self.bf16 = self.cfg.model.precision(self.on_cuda) == "bf16"
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        if not self.on_cuda:
            torch.set_num_threads(self.cfg.trainer.torch_threads)
        torch.manual_seed(self.cfg.seed)
        self.device_peaks: dict[str, float] = {}  # device-wide GB in use, by the phase that was sampled
        self.fused: dict[str, int] = {}  # modules given the lean forward, by kind
        self.compiled_layers = 0  # decoder layers compiled (`model.compile_layers`)
        self.grad_checks = ""  # what the trained model's optimizer steps check gradients with (`_initialize`)
        self.compile_backend: Any = "inductor"  # what compiles them (`_compile_layers`)
        self.profiler = StepProfiler(self.on_cuda)
        self.gc_clock = GcClock()
        self.heap_frozen = 0  # objects frozen after the first step's report (`zbench.engine.heap`)
        self.choose_attention_kernels()

    models: tuple[str, ...] = ("engine",)  # the attributes holding what `setup` builds from the checkpoint

    def setup(self) -> dict[str, Any]:
        """Build this role's models from the checkpoint; returns what they are (each role defines it)."""
        raise NotImplementedError(f"{type(self).__name__} builds no models")

    def release(self) -> str:
        """Drop the models `setup` built and give their memory back (device and host), for the next trial
        (`reconfigure`). Every worker of a session releases before any rebuilds, so no rebuild runs beside
        another process's previous models.

        Returns what the process still holds of the models it ever released ("" when nothing, `carried_report`):
        a model or optimizer still referenced from somewhere keeps its memory, which every later trial of this
        process would measure as its own (`zbench.engine.trainer.Trainer.retarget` says so in the trial's log)."""
        for name in self.models:
            model = getattr(self, name, None)
            if model is not None:
                _RELEASED.append(weakref.ref(getattr(model, "module", model)))
                if getattr(model, "optimizer", None) is not None:  # ZeRO-1/2's holds no reference to the module
                    _RELEASED.append(weakref.ref(model.optimizer))
            setattr(self, name, None)
            if model is not None and hasattr(model, "destroy"):  # a DeepSpeed engine: its hooks and buffers
                model.destroy()
                _forget_zero3_module(model.module)
        model = None  # the loop's last model must be unreachable before the collection and the cache release below
        release_dropped()
        self.heap_frozen = 0
        if self.on_cuda:
            torch.cuda.empty_cache()
        return carried_report(self.role, self.rank, self.device if self.on_cuda else None)

    def reconfigure(self, cfg: RunConfig, case_dir: str) -> dict[str, Any]:
        """Become the worker of `cfg`, a trial of the same case at another batch geometry, whose folder is
        `case_dir` (`zbench.engine.session`): the models are dropped (`release`) and built again from the checkpoint
        with the case's seed, as a new process builds them, so every trial starts where a case starts. The process
        group and the policy's rollout engine stay. Peak memory, collector pauses and the frozen heap start again;
        returns what `setup` returns."""
        self.release()
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
        self.cfg, self.case_dir = cfg, Path(case_dir)
        torch.manual_seed(cfg.seed)
        self.device_peaks = {}
        self.gc_clock.take()
        self.fused, self.compiled_layers = {}, 0
        return self.setup()

    def choose_attention_kernels(self) -> None:
        """PyTorch's cuDNN attention builds an execution plan for every new shape, milliseconds of host time per
        layer and pass, and an RL micro-batch's length changes every time; off unless `model.sdpa_cudnn`. vLLM
        turns it off when imported, so the policy worker applies this again after building its engine."""
        if self.on_cuda:
            torch.backends.cuda.enable_cudnn_sdp(self.cfg.model.sdpa_cudnn)

    def profile_start(self) -> None:
        """Start profiling this worker (the step named by `trainer.profile_step`); a profiler that cannot start
        leaves the step unprofiled, not failed."""
        try:
            self.profiler.start(self.cfg.trainer.profiler)
        except Exception as err:
            print(f"[profile] {self.role} rank {self.rank}: profiler did not start: {type(err).__name__}: {err}",
                  flush=True)

    def profile_stop(self, step: int) -> list[dict[str, Any]]:
        """Stop profiling; write `<case>/profile/step<K>-<role>-rank<R>.txt` (and, from torch.profiler, its
        `.json.gz` trace); return the phase lines."""
        stem = f"step{step}-{self.role}-rank{self.rank}"
        title = f"{self.case_dir.name}: step {step}, {self.role} worker, rank {self.rank} of {self.world_size}"
        try:
            phases = self.profiler.stop(self.case_dir / "profile", stem, title)
        except Exception as err:  # a profile that cannot be written must not fail the case it measures
            print(f"[profile] {stem}: no profile written: {type(err).__name__}: {err}", flush=True)
            return []
        # torch.profiler's phases with their parts under them, as the text report lists them; cProfile's as they are
        timed = [p for p in phases if isinstance(p, PhaseProfile)]
        rows = phase_rows(timed) if len(timed) == len(phases) else [(p.phase, p) for p in phases]
        return [{"phase": label.strip(), "wall_ms": p.wall_ms, "line": p.line()} for label, p in rows]

    def sample_device_memory(self, phase: str, extra_gb: float = 0.0) -> None:
        """Note the memory in use on this GPU by every process (what nvidia-smi shows) at the end of `phase`
        ("gen", "train" or "step_end"), for `memory()`.

        torch's peak counters miss what other processes hold and, with vLLM's sleep mode, still count the
        engine's released memory; the device-wide figure, sampled where each phase's memory is still held (end
        of an update, before vLLM sleeps), is the footprint that decides whether a case fits. Kept by phase, so
        a record says which phase set the peak (training's activations may grow into the memory a sleeping
        rollout engine gave back without raising it)."""
        if self.on_cuda:
            used = max(gpu_memory_in_use_gb(self.device), extra_gb)
            self.device_peaks[phase] = max(self.device_peaks.get(phase, 0.0), used)

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the group's rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()  # 127.0.0.1 for a private Ray: the rendezvous stays on loopback
        return ip, free_port(ip)

    def join(self, master_addr: str, master_port: int) -> None:
        """Join this group's torch.distributed group."""
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )
        deepspeed = import_deepspeed()  # its Muon modules uncompiled
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if self.on_cuda:
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.on_cuda else "gloo"
        join_process_group(backend, master_addr, master_port, self.rank, self.world_size,
                           self.device if self.on_cuda else None)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)

    def _ds_train_config(self, micro: int, grad_accum: int, lr: float, weight_decay: float, grad_clip: float) -> dict:
        from zbench.engine.ds_config import nvme_folder, training_config

        return training_config(
            self.cfg.zero, self.offload, micro_batch=micro, grad_accum=grad_accum, world_size=self.world_size,
            lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, bf16=self.bf16, on_cuda=self.on_cuda,
            nvme_path=nvme_folder(self.cfg.zero, self.case_dir),
        )

    def _load(self, auto_cls: Any, ds_config: dict, **kwargs: Any) -> torch.nn.Module:
        """Load the model; under ZeRO-3 its parameters are partitioned as they load (`zero.Init`)."""
        zero3 = None
        if self.cfg.zero.stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            zero3 = HfDeepSpeedConfig(ds_config)  # must stay referenced while from_pretrained runs
        try:
            model = auto_cls.from_pretrained(self.model_path, dtype=self.dtype, **kwargs)
        finally:
            if zero3 is not None:
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                # the hook is global: left set, every later from_pretrained (replica, reference) is partitioned too
                unset_hf_deepspeed_config()
                del zero3
        self._fuse(model)
        if self.cfg.model.maskless_attention:
            response_decoder(model)  # a model the layout cannot run fails here, before any step
        if self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._keep_activations(model, self.cfg.model.checkpoint_layers)
        model.config.use_cache = False
        if self.cfg.model.compile_layers == "always" and not self.on_cuda:
            raise ConfigError("model.compile_layers", "'always' compiles for CUDA only and this case trains on the "
                                                      "CPU; use 'auto' or 'never'")
        if self._compiles_layers():
            self._compile_layers(model, self.compile_backend)
        elif self.cfg.model.activation_memory_budget < 1.0:
            raise ConfigError("model.activation_memory_budget", f"{self.cfg.model.activation_memory_budget} shares "
                                                                "a compiled layer's activations, and this case's layers "
                                                                "are not compiled (model.compile_layers=auto compiles "
                                                                "on CUDA only); use a budget of 1")
        return model

    def _compiles_layers(self) -> bool:
        """Whether this worker compiles its models' decoder layers (`model.compile_layers`)."""
        return self.cfg.model.compiles_layers(self.on_cuda)

    def _compile_layers(self, model: torch.nn.Module, backend: Any = "inductor") -> None:
        """`torch.compile` each decoder layer in place (`model.compile_layers`): the layers share one graph, shapes
        are dynamic (an RL micro-batch's length changes every time).

        Under ZeRO-3 the layers first become DeepSpeed leaf modules (`zero3_leaf_layers`), and only each layer's
        `forward` is compiled: the parameter gathers and releases stay in the module call's hooks, outside the
        graph, so the layer's body compiles whole instead of breaking at every projection's gather. The guards on
        DeepSpeed's parameter numbers are dropped (`skip_zero3_param_ids`), so one graph serves every layer."""
        layers = self._decoder_layers(model)
        if self.cfg.model.activation_memory_budget < 1.0:
            backend = budgeted_backend(backend, self.cfg.model.activation_memory_budget)
        if self.cfg.zero.stage == 3:
            zero3_leaf_layers(model, layers)
            for layer in layers:
                layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend,
                                              options={"guard_filter_fn": skip_zero3_param_ids})
        else:
            for layer in layers:
                layer.compile(dynamic=True, backend=backend)
        self.compiled_layers = len(layers)

    def _keep_activations(self, model: torch.nn.Module, checkpointed: int | None) -> None:
        """Under activation checkpointing, the decoder layers past the first `checkpointed` keep their activations
        for the backward instead of recomputing them (`model.checkpoint_layers`; None: every layer recomputes)."""
        if checkpointed is None:
            return
        layers = self._decoder_layers(model, "model.checkpoint_layers")
        if checkpointed > len(layers):
            raise ConfigError("model.checkpoint_layers", f"{checkpointed} is more than the {len(layers)} decoder "
                                                         f"layers of {self.model_path}; at most {len(layers)}, or null")
        for layer in layers[checkpointed:]:
            if not hasattr(layer, "gradient_checkpointing"):
                raise ConfigError("model.checkpoint_layers", f"{type(layer).__name__} has no per-layer checkpointing "
                                                             "switch; leave it null")
            layer.gradient_checkpointing = False

    @staticmethod
    def _decoder_layers(model: torch.nn.Module, key: str = "model.compile_layers") -> torch.nn.ModuleList:
        layers = getattr(response_decoder(model), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            fix = "set it to 'never'" if key == "model.compile_layers" else "leave it null"
            raise ConfigError(key, f"{type(model).__name__} has no decoder `layers` list; {fix}")
        return layers

    def _fuse(self, model: torch.nn.Module) -> None:
        """The lean RMSNorm and SwiGLU of `zbench.engine.fused`, unless `model.fused_ops` is off."""
        if self.cfg.model.fused_ops:
            from zbench.engine.fused import fuse

            self.fused = fuse(model)

    def _initialize(self, model: torch.nn.Module, ds_config: dict) -> Any:
        """A trained model's DeepSpeed engine; with `zero.fused_grad_checks`, its step's gradient checks fused where
        they apply (`self.grad_checks` says what its steps check with)."""
        import deepspeed

        from zbench.engine.grad_checks import fuse_grad_checks

        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                           if p.requires_grad], config=ds_config)
        self.grad_checks = fuse_grad_checks(engine) if self.cfg.zero.fused_grad_checks else "deepspeed (off)"
        return engine

    def _train(self, batch: Batch, micro: int, loss_agg: str,
               loss_fn: Callable[[Batch, dict[str, list[torch.Tensor]], float | None], torch.Tensor],
               ) -> tuple[dict[str, float], list[torch.Tensor | None]]:
        """ppo_epochs passes over this rank's batch in mini-batches (one optimizer step each, DeepSpeed
        accumulating the micro-batches); returns the mean of every recorded statistic, grad norm and lr, and each
        mini-batch's row order (`length_order`, or None where its rows kept theirs).

        `loss_fn(micro_batch, stats, denom)` averages over tokens as `algos.masked_mean` does with `denom`: None
        (`loss_agg` micro-token-mean) is the micro-batch's own token mean; under token-mean it is the
        `token_share_denominator` of the optimizer step's response tokens (the batch's `step_tokens`, from the
        trainer's `mini_batch_tokens`), so every token of the step weighs the same and the micro-batches may be cut
        from rows sorted by length. Statistics recorded that way average, over micro-batches and ranks, to the
        step's token mean.

        Statistics stay on the device until the end: a `.item()` per micro-batch would make the host wait for
        the GPU each time, so it could never queue the next micro-batch's kernels while the last ones run."""
        plan = self.cfg.batch_plan()
        self.engine.train()
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        token_mean = loss_agg == "token-mean"
        minis: list[tuple[list[Batch], torch.Tensor | None, float | None]] = []
        for mini in micro_batches(batch, plan.mini_batch_sequences // self.world_size):
            step_tokens = mini.pop("step_tokens", None)
            micro_batches_, order = self._forward_batches(mini, micro, sort=token_mean)
            if len(micro_batches_) != self.engine.gradient_accumulation_steps():  # DeepSpeed divides by its own count
                raise ValueError(f"a mini-batch of {len(micro_batches_)} micro-batches, but DeepSpeed accumulates "
                                 f"{self.engine.gradient_accumulation_steps()}: the batch does not fill the batch plan")
            denom = None
            if token_mean:
                if step_tokens is None and self.world_size > 1:
                    raise ValueError("a token-mean update on several ranks needs the batch's step_tokens "
                                     "(zbench.engine.batches.mini_batch_tokens)")
                if step_tokens is not None and not bool((step_tokens == step_tokens[0]).all()):
                    raise ValueError("step_tokens differ within one mini-batch: they must be its step's token count")
                tokens = int(step_tokens[0]) if step_tokens is not None else int(mini["response_mask"].sum())
                denom = token_share_denominator(max(tokens, 1), len(micro_batches_), self.world_size)
            minis.append((micro_batches_, order, denom))
        for _ in range(self.cfg.actor.ppo_epochs):
            for micro_batches_, _order, denom in minis:
                accumulated_step(self.engine, (loss_fn(mb, stats, denom) for mb in micro_batches_),
                                 self.cfg.zero.coalesce_grad_reduction)
                norm = self.engine.get_global_grad_norm()
                if norm is not None:
                    stats[f"{self.role}/grad_norm"].append(torch.as_tensor(norm, dtype=torch.float32))
        out = {k: float(torch.stack([t.detach().float().cpu() for t in v]).mean()) for k, v in stats.items()}
        out[f"{self.role}/lr"] = self.engine.get_lr()[0]
        self.sample_device_memory("train")
        return out, [order for _, order, _ in minis]

    def optimizer_name(self) -> str:
        """The optimizer that steps the parameters, inside DeepSpeed's ZeRO wrapper (e.g. DeepSpeedCPUAdam)."""
        inner = getattr(self.engine, "basic_optimizer", None) or self.engine.optimizer
        wrapper = type(self.engine.optimizer).__name__
        return type(inner).__name__ if inner is self.engine.optimizer else f"{wrapper}({type(inner).__name__})"

    def memory(self) -> dict[str, float]:
        """The step's report, once per step: peak accelerator memory since the last call (then reset), this
        process's resident memory and its garbage-collector pauses. After the first report, the objects alive
        (models, engines, compiled graphs) are frozen out of the collector's walks (`zbench.engine.heap`); the
        full collection that precedes the freeze counts in the first step's pauses."""
        if not self.heap_frozen:
            self.heap_frozen = freeze_survivors()
        out = {"rss_gb": psutil.Process().memory_info().rss / 2**30, "gc_pause_s": self.gc_clock.take()}
        if self.on_cuda:
            out["allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            out["reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
            self.sample_device_memory("step_end")
            out["device_used_gb"] = max(self.device_peaks.values())
            out.update({f"device_{phase}_gb": gb for phase, gb in self.device_peaks.items() if phase != "step_end"})
            self.device_peaks = {}
        return out

    def save(self, ckpt_dir: str, tag: str) -> None:
        """DeepSpeed checkpoint of this group's engine (model, optimizer, its own RNG and step counters)."""
        self.engine.save_checkpoint(ckpt_dir, tag=tag)

    def load(self, ckpt_dir: str, tag: str) -> None:
        """Restore this group's engine from a DeepSpeed checkpoint."""
        path, _ = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no {self.role} checkpoint {tag!r} under {ckpt_dir}")

    def shutdown(self) -> None:
        """Leave the process group cleanly (a gloo group torn down at exit can abort the interpreter)."""
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _forward_batches(self, batch: Batch, size: int, sort: bool = True) -> tuple[list[Batch], torch.Tensor | None]:
        """This rank's (host) batch as device micro-batches of `size` rows, laid out as `model.maskless_attention`
        says (`forward_batches`). With `sort` and `trainer.sort_micro_batches`, cut from the rows in
        `length_order`, which is returned (else None) so that outputs can be put back `in_row_order`."""
        maskless = self.cfg.model.maskless_attention
        order = length_order(batch, maskless) if sort and self.cfg.trainer.sort_micro_batches else None
        if order is not None:
            batch = {k: v[order] for k, v in batch.items()}
        # compiled layers specialise on whether the width is a multiple of 8: always one, so they compile once
        align = 8 if self.compiled_layers else 1
        mbs = forward_batches(batch, size, maskless, align)
        return [self._to_device(mb) for mb in mbs], order


class PolicyWorker(_Worker):
    """Actor (DeepSpeed, trained), rollout replica (generation) and frozen reference, on one rank."""

    role = "actor"
    models = ("engine", "ref")

    def release(self) -> str:
        """As every worker releases, with a vLLM rollout put to sleep first: a new process builds its training
        engine before vLLM holds any memory, and so does a rebuild."""
        sleep = getattr(getattr(self, "rollout", None), "sleep", None)
        if sleep is not None:
            sleep()
        return super().release()

    def setup(self) -> dict[str, Any]:
        """Build the actor engine, the reference and (unless one is kept from an earlier trial) the rollout."""
        from transformers import AutoModelForCausalLM

        cfg, plan = self.cfg, self.cfg.batch_plan()
        ds_cfg = self._ds_train_config(cfg.actor.micro_batch_size_per_gpu, plan.grad_accum["actor"], cfg.actor.lr,
                                       cfg.actor.weight_decay, cfg.actor.grad_clip)
        self.engine = self._initialize(self._load(AutoModelForCausalLM, ds_cfg), ds_cfg)
        self.ref = self._build_ref() if cfg.needs_reference else None
        if getattr(self, "rollout", None) is None:
            pad_id, eos_ids = special_ids(self.model_path)
            self.rollout = self._build_rollout(pad_id, eos_ids)
        self.choose_attention_kernels()
        self.sync_weights()
        n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.engine.module.parameters())
        return {"params": n_params, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "optimizer": self.optimizer_name(), "grad_checks": self.grad_checks, "backend": self.rollout.backend,
                "engine": self.rollout.engine,
                "model_runner": getattr(self.rollout, "model_runner", None),  # vLLM's, where it says which
                "decode_attention": getattr(self.rollout, "decode_attention", None),  # the hf graph loop's
                "merged_projections": getattr(self.rollout, "merged_projections", None),  # the hf graph loop's
                "decode_kernels": getattr(self.rollout, "decode_kernels", None),  # the hf graph loop's Triton switches
                "steps_per_graph": getattr(self.rollout, "steps_per_graph", None),  # the graph loop's, as it runs
                "prompt_width": getattr(self.rollout, "prompt_width", None),  # the graph loop's one width, if any
                "sampling": getattr(self.rollout, "graph_sampling", None),  # where the graph loop draws
                "kv_cache": getattr(self.rollout, "kv_cache", None),  # the graph loop's between rollouts
                "prefill": getattr(self.rollout, "prefill", None),  # the graph loop's: compiled or eager
                "cpu_threads": torch.get_num_threads(),
                # Ray raises its workers' niceness by 15 (RAY_worker_niceness): a rollout's host loop runs at it
                "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                "sdpa_cudnn": bool(self.on_cuda and torch.backends.cuda.cudnn_sdp_enabled()), "fused_ops": self.fused,
                "compiled_layers": self.compiled_layers,
                # the head computes log-probs itself only where it is a plain Linear (zbench.engine.lm_head)
                "fused_head": (fused_head := cfg.model.fused_head and lm_head.fusable_head(self.engine) is not None),
                "head_loss_in_forward": fused_head and cfg.model.head_loss_in_forward,
                "gpu_name": torch.cuda.get_device_name(self.device) if self.on_cuda else None}

    def _build_ref(self) -> Any:
        from transformers import AutoModelForCausalLM

        from zbench.engine.ds_config import inference_config, nvme_folder

        if self.cfg.zero.stage == 3:
            ds_cfg = inference_config(self.cfg.zero, self.offload, world_size=self.world_size, bf16=self.bf16,
                                      on_cuda=self.on_cuda, nvme_path=nvme_folder(self.cfg.zero, self.case_dir))
            model = self._load(AutoModelForCausalLM, ds_cfg)
            for p in model.parameters():
                p.requires_grad_(False)
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
            engine.eval()
            return engine
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
        self._fuse(model)
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def _build_rollout(self, pad_id: int, eos_ids: list[int]) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        from zbench.engine import vllm_rollout
        from zbench.engine.rollout import HFRollout

        r = self.cfg.rollout
        backend = vllm_rollout.select_backend(r.backend, self.on_cuda, vllm_rollout.installed_vllm(), torch.__version__,
                                              self.on_cuda and auto_takes_graph_loop(self.cfg))
        self.park_replica = False
        if backend == "vllm":
            tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
            return vllm_rollout.build(self.model_path, self.cfg, pad_id, eos_ids, self.rank, tied)
        replica = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        if any(hasattr(p, "ds_id") for p in replica.parameters()):
            raise RuntimeError("the rollout replica was partitioned by ZeRO-3; it must hold full weights")
        self.replica_home = self.device
        self.park_replica = self.on_cuda and replica_parks(self.cfg)
        replica.to("cpu" if self.park_replica else self.device)
        return HFRollout(replica, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=r.max_new_tokens,
                         temperature=r.temperature, top_p=r.top_p, static_cache=r.static_cache and self.on_cuda,
                         device=self.device, cuda_graph=r.cuda_graph, parked=self.park_replica,
                         decode_attention=r.decode_attention, prompt_width=self.cfg.data.max_prompt_length,
                         samples=r.n, release_kv_cache=r.release_kv_cache,
                         steps_per_graph=r.steps_per_graph, compile_prefill=r.compile_prefill)

    @phase("gen")
    def generate(self, batch: Batch, step: int) -> Batch:
        """Sample responses for this rank's prompts (already repeated n times), seeded by (seed, step, rank); the
        ranks of one vLLM tensor-parallel group share their prompts and their seed."""
        if self.park_replica:
            self.rollout.to(self.device)
        seed = self.cfg.seed * 1_000_003 + step * 1_009 + self.rank // self.cfg.rollout.tensor_parallel_size
        out = self.rollout.generate(batch["input_ids"], batch["attention_mask"], seed)
        with phase_part("gen/record"):
            # where the phase's time went on this rank: one row per rank, the trainer reports the slowest
            for name, seconds in self.rollout.seconds.items():
                out[f"rollout_{name}_s"] = torch.tensor([seconds])
            if getattr(self.rollout, "shared_rows", None) is not None:  # the graph loop's
                out["rollout_shared_rows"] = torch.tensor([self.rollout.shared_rows])
            self.sample_device_memory("gen", getattr(self.rollout, "awake_used_gb", 0.0))
        if self.park_replica:
            self.rollout.to("cpu")
            torch.cuda.empty_cache()
        return out

    def _logprobs(self, model: Any, mb: Batch, entropy: bool = False,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs and, if asked, per-token entropy (with gradients only when it is in the loss)."""
        width = mb["responses"].shape[1]
        temperature = self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0
        head = lm_head.fusable_head(model) if self.cfg.model.fused_head else None
        if head is not None:  # the head itself returns (log-prob, entropy) per response token
            with lm_head.head_computes_stats(head, mb["responses"], temperature, entropy, entropy_grad):
                stats = model_outputs(model, mb, logits_to_keep=width + 1).logits
            return stats[..., 0], stats[..., 1] if entropy else None
        out = model_outputs(model, mb, logits_to_keep=width + 1)
        # chunked (and checkpointed under autograd): no float32 copy of the micro-batch's whole logits is kept
        return algos.token_logprobs_and_entropy(out.logits[:, :-1], mb["responses"], temperature,
                                                with_entropy=entropy, entropy_grad=entropy_grad)

    def _loss_head(self) -> torch.nn.Module | None:
        """The actor's head where it takes the update's loss itself (`model.head_loss_in_forward` on a fusable head,
        under autograd); None where the loss is taken after it."""
        if not (self.cfg.model.head_loss_in_forward and torch.is_grad_enabled()):  # the config asks for fused_head
            return None
        return lm_head.fusable_head(self.engine)

    def _loss_in_head(self, head: torch.nn.Module, mb: Batch, entropy_grad: bool, token_loss: lm_head.TokenLoss
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs, entropies, loss) of the actor on `mb`, the loss `token_loss` over its flattened response
        tokens taken inside `head` (`lm_head.head_loss`)."""
        temperature = self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0
        with lm_head.head_computes_stats(head, mb["responses"], temperature, True, entropy_grad,
                                         lm_head.DEFAULT_CHUNK_TOKENS, token_loss):
            stats = model_outputs(self.engine, mb, logits_to_keep=mb["responses"].shape[1] + 1).logits
        if stats.shape[-1] != 3:
            raise RuntimeError(f"the head returned {stats.shape[-1]} statistics per token, not (log-prob, entropy, "
                               "loss): it did not take the loss")
        return stats[..., 0], stats[..., 1], stats[0, 0, 2]

    @torch.no_grad()
    def _score(self, model: Any, batch: Batch, key: str) -> Batch:
        mbs, order = self._forward_batches(batch, forward_micro(self.cfg.actor))
        outs = [on_response(self._logprobs(model, mb)[0], mb) for mb in mbs]
        # one copy to the host: no wait for the GPU between micro-batches
        return {key: in_row_order(torch.cat(outs).cpu(), order)}

    @phase("old_log_prob")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the sampled responses under the current actor (the PPO `old` policy)."""
        self.engine.eval()
        return self._score(self.engine, batch, "old_log_probs")

    @phase("ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Log-probs under the frozen reference."""
        return self._score(self.ref, batch, "ref_log_probs")

    @phase("update_actor")
    def update_actor(self, batch: Batch) -> dict[str, Any]:
        """ppo_epochs passes of clipped policy-gradient updates over this rank's share of the step's batch.

        A batch without `old_log_probs` (`RunConfig.old_log_prob_pass` false: one epoch of one mini-batch) takes
        the update's own log-probs, detached, as the old ones; they are returned as `old_log_probs` (host, in row
        order) beside the statistics, as the skipped pass would have given them."""
        a = self.cfg.actor
        reused = "old_log_probs" not in batch
        if reused and (a.ppo_epochs != 1 or self.cfg.batch_plan().mini_batch_sequences // self.world_size
                       != next(iter(batch.values())).shape[0]):
            raise ValueError("update_actor needs old_log_probs unless it runs one epoch of one mini-batch")
        own: list[torch.Tensor] = []

        def terms(logp: torch.Tensor, ent: torch.Tensor, mb: Batch, rows: slice | None,
                  denom: float | torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            """The loss of `mb`'s tokens (all, or `rows` of its flattened [B, R]) and its statistics: a sum of
            per-token terms over `denom` (the token count of what the loss is the mean of)."""
            def part(key: str) -> torch.Tensor:
                return mb[key] if rows is None else mb[key].reshape(-1)[rows]

            mask = part("response_mask")
            old = logp.detach() if reused else part("old_log_probs")
            pg_loss, clipfrac, ppo_kl = algos.policy_loss(old, logp, part("advantages"), mask, a.clip_ratio_low,
                                                          a.clip_ratio_high, a.clip_ratio_c or None, denom=denom)
            entropy = algos.masked_mean(ent, mask, denom=denom)
            loss = pg_loss - a.entropy_coeff * entropy
            stats: dict[str, torch.Tensor] = {}
            if a.use_kl_loss:
                kl = algos.masked_mean(algos.kl_penalty(logp, part("ref_log_probs"), a.kl_loss_type), mask,
                                       denom=denom)
                loss = loss + a.kl_loss_coef * kl
                stats["actor/kl_loss"] = kl
            stats |= {"actor/pg_loss": pg_loss, "actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl,
                      "actor/entropy": entropy}
            return loss, stats

        def loss_fn(mb: Batch, stats: dict[str, list[torch.Tensor]], denom: float | None) -> torch.Tensor:
            entropy_grad = a.entropy_coeff > 0
            head = self._loss_head()
            if head is not None:
                # a chunk's loss is its share of the micro-batch's: over the micro-batch's denominator, not its own
                whole = denom if denom is not None else mb["response_mask"].sum().clamp_min(1)
                logp, ent, loss = self._loss_in_head(head, mb, entropy_grad, lambda lp, en, rows: terms(
                    lp, en if en is not None else torch.zeros_like(lp), mb, rows, whole)[0])
                with torch.no_grad():
                    _, values = terms(logp, ent, mb, None, whole)
            else:
                logp, ent = self._logprobs(self.engine, mb, entropy=True, entropy_grad=entropy_grad)
                loss, values = terms(logp, ent, mb, None, denom)
            if reused:
                own.append(on_response(logp.detach(), mb))
            for key, value in values.items():
                stats[key].append(value.detach())
            return loss

        out: dict[str, Any]
        out, orders = self._train(batch, a.micro_batch_size_per_gpu, a.loss_agg, loss_fn)
        if reused:  # one mini-batch: its rows' order
            out["old_log_probs"] = in_row_order(torch.cat(own).float().cpu(), orders[0])
        return out

    @phase("update_weights")
    @torch.no_grad()
    def sync_weights(self) -> dict[str, float]:
        """Copy the trained weights into the rollout replica (ZeRO-3: gathered bucket by bucket)."""
        from zbench.engine.rollout import trained_weights

        start = time.perf_counter()
        parked = self.park_replica
        copied = self.rollout.load_weights(
            trained_weights(self.engine.module, self.cfg.zero.stage, self.cfg.rollout.sync_bucket_mb))
        if self.on_cuda and not parked:
            torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - start, "bytes": float(copied)}


class CriticWorker(_Worker):
    """The PPO value model on one rank: a token-level scalar head over the actor's architecture."""

    role = "critic"

    def setup(self) -> dict[str, Any]:
        """Build the critic engine."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        c, plan = self.cfg.critic, self.cfg.batch_plan()
        ds_cfg = self._ds_train_config(c.micro_batch_size_per_gpu, plan.grad_accum["critic"], c.lr, c.weight_decay,
                                       c.grad_clip)
        # no dropout in the value head: values must not depend on RNG state (parity across stages)
        config = AutoConfig.from_pretrained(self.model_path, num_labels=1)
        config.classifier_dropout = 0.0
        model = self._load(AutoModelForTokenClassification, ds_cfg, config=config)
        self.engine = self._initialize(model, ds_cfg)
        return {"optimizer": self.optimizer_name(), "grad_checks": self.grad_checks, "fused_ops": self.fused,
                "compiled_layers": self.compiled_layers}

    def _values(self, mb: Batch) -> torch.Tensor:
        width = mb["responses"].shape[1]
        out = model_outputs(self.engine, mb)
        return out.logits[:, -width - 1 : -1, 0].float() * mb["response_mask"]

    @phase("values")
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """V(s_t) for every response token."""
        self.engine.eval()
        mbs, order = self._forward_batches(batch, forward_micro(self.cfg.critic))
        outs = [self._values(mb) for mb in mbs]
        return {"values": in_row_order(torch.cat(outs).cpu(), order)}  # one copy to the host, as the actor's passes

    @phase("update_critic")
    def update_critic(self, batch: Batch, report_memory: bool = False) -> dict[str, Any]:
        """Clipped value-loss regression to the returns, over the same mini-batches as the actor. Beside the
        statistics, `seconds`: how long this rank's update took, its results on the host (`trainer.critic_update`
        concurrent and overlap time it here, as the controller meanwhile waits on the actor); with `report_memory`,
        `memory`: this process's step report (`memory`), taken at the end of the update (overlap, where nothing
        may call the critic before its update is done)."""
        start = time.perf_counter()
        c = self.cfg.critic

        def loss_fn(mb: Batch, stats: dict[str, list[torch.Tensor]], denom: float | None) -> torch.Tensor:
            vf_loss, clipfrac = algos.value_loss(self._values(mb), mb["values"], mb["returns"], mb["response_mask"],
                                                 c.cliprange_value, denom=denom)
            stats["critic/vf_loss"].append(vf_loss.detach())
            stats["critic/vf_clipfrac"].append(clipfrac.detach())
            return vf_loss

        out: dict[str, Any] = {**self._train(batch, c.micro_batch_size_per_gpu, c.loss_agg, loss_fn)[0],
                               "seconds": time.perf_counter() - start}
        if report_memory:
            out["memory"] = self.memory()
        return out
