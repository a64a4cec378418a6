"""Predicted model-state memory of a case, per rank, from the ZeRO formulas, before anything runs.

Bytes per parameter (Rajbhandari et al., "ZeRO", 2020), with Adam:

    precision   params  grads  optimizer (fp32 master + Adam m, v)
    bf16 mixed       2      2     12
    fp32             4      4      8

Stage 1 partitions the optimizer states over the data-parallel ranks, stage 2 also the gradients, stage 3
also the parameters. With `zero.coalesce_grad_reduction` at stage 2 or 3 each rank also holds the whole gradients
through a mini-batch's accumulation, reduced into its partition only after the last micro-batch. Offload moves the
optimizer states (and at stage 3 the parameters) to CPU or NVMe.
ZeRO-3 gathers one module's parameters at a time; its working set is the largest module (the embedding in
Qwen3-shaped models), counted with its gradient. On top of the trained actor, each rank keeps a frozen
reference copy and a rollout replica (full copies at parameter precision; the replica lives on the host when
the case offloads), and PPO trains a critic of the actor's size with its own ZeRO states.

Where this differs from DeepSpeed's own estimators
(``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold`` and
``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold``), and why:

- DeepSpeed counts 18 bytes per partitioned parameter where this module counts 16 (stage 3) or 14
  (stage 2, params replicated): it adds the fp32 gradient partition its optimizer step keeps (4 bytes at
  stage 2, a net 2 at stage 3). With the optimizer offloaded it moves the gradient partitions to the host
  as well; here they stay counted on the GPU (2 bytes/param/rank), as they are produced there before the
  copy. The tests pin both differences exactly.
- DeepSpeed's host figures multiply by ``additional_buffer_factor`` (1.5) and, without ZeRO-Init, count a
  full fp32 model per GPU for loading; this module predicts steady state, so neither is included.
- DeepSpeed has no ZeRO-1 estimator (stage 1 is stage 2 with replicated gradients here) and neither
  estimator has an activation, KV-cache or allocator-fragmentation term; so measured ``max_memory_reserved``
  sits above these figures by the activations of the largest micro-batch and the rollout's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zbench.analyze.model_size import model_size
from zbench.config import RunConfig, effective_offload

GIB = 2**30


# Bytes per parameter: (params, grads, optimizer states).
BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True, slots=True)
class Placement:
    """Bytes per rank of one trained model's states, by where they live."""

    gpu: int = 0
    cpu: int = 0
    nvme: int = 0


def model_states(n_params: int, largest_layer: int, stage: int, offload: str, dp: int,
                 precision: str = "bf16", coalesced: bool = False) -> Placement:
    """Per-rank bytes of parameters, gradients and optimizer states of one model trained with ZeRO; `coalesced`
    (`zero.coalesce_grad_reduction`): the whole gradients as well as the partition at stage 2 and 3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.stage must be 0..3, got {stage}")
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, got {precision!r}")
    p_b, g_b, o_b = BYTES_PER_PARAM[precision]
    params = n_params * p_b / (dp if stage >= 3 else 1)
    grads = n_params * g_b / (dp if stage >= 2 else 1) + (n_params * g_b if coalesced and stage >= 2 else 0)
    optim = n_params * o_b / (dp if stage >= 1 else 1)
    working = largest_layer * (p_b + g_b) if stage == 3 else 0
    if stage == 0 and offload in ("cpu", "nvme"):
        raise ValueError(f"zero.offload={offload!r} with zero.stage=0: nothing to offload; use stage 1, 2 or 3")
    off = effective_offload(stage, offload)  # the engine's own rule (ZeRO-1/2 keep "nvme" in CPU memory)
    where = {"gpu": params + grads + working, "cpu": 0.0, "nvme": 0.0}
    where["gpu" if off.optimizer == "none" else off.optimizer] += optim
    if off.params != "none":
        where["gpu"] -= params
        where[off.params] += params
    return Placement(gpu=int(where["gpu"]), cpu=int(where["cpu"]), nvme=int(where["nvme"]))


@dataclass(frozen=True, slots=True)
class CaseEstimate:
    """Predicted per-rank memory of one case, in bytes, with its parts."""

    case: str
    algorithm: str
    stage: int
    offload: str
    offload_effective: str
    world_size: int
    precision: str
    n_params: int
    actor: Placement
    critic: Placement | None
    reference_bytes: int
    replica_bytes: int
    replica_on_gpu: bool

    @property
    def gpu_bytes(self) -> int:
        """Accelerator bytes per rank: actor and critic states, reference, replica unless offloaded."""
        extra = self.critic.gpu if self.critic else 0
        return self.actor.gpu + extra + self.reference_bytes + (self.replica_bytes if self.replica_on_gpu else 0)

    @property
    def cpu_bytes(self) -> int:
        """Host bytes per rank: offloaded states and the replica when the case offloads."""
        extra = self.critic.cpu if self.critic else 0
        return self.actor.cpu + extra + (0 if self.replica_on_gpu else self.replica_bytes)

    @property
    def nvme_bytes(self) -> int:
        """NVMe bytes per rank (offload=nvme)."""
        return self.actor.nvme + (self.critic.nvme if self.critic else 0)


def estimate_case(cfg: RunConfig, base_dir: Path | None = None, name: str = "",
                  on_cuda: bool | None = None) -> CaseEstimate:
    """Predict one case's per-rank memory from its config: parameters counted by transformers from the model's own
    config, in the precision the engine trains it in: on CUDA or not as ``on_cuda`` says (a run that already ran),
    else as it would run on this machine."""
    size = model_size(cfg.model.path, base_dir)
    stage, offload, dp = cfg.zero.stage, cfg.zero.offload, cfg.trainer.world_size
    precision = cfg.model.precision(cfg.trainer.uses_cuda() if on_cuda is None else on_cuda)
    n, largest = size.n_params, size.largest_module_params
    coalesced = cfg.zero.coalesce_grad_reduction
    actor = model_states(n, largest, stage, offload, dp, precision, coalesced)
    critic = model_states(n, largest, stage, offload, dp, precision, coalesced) if cfg.needs_critic else None
    copy = n * BYTES_PER_PARAM[precision][0]
    eff = effective_offload(stage, offload).label
    return CaseEstimate(
        case=name, algorithm=cfg.algorithm, stage=stage, offload=offload,
        offload_effective=eff, world_size=dp, precision=precision, n_params=n, actor=actor, critic=critic,
        reference_bytes=copy, replica_bytes=copy, replica_on_gpu=eff == "none",
    )


def target_cases(target: str | Path, on_cuda: bool | None = None, sets: tuple[tuple[str, object], ...] = (),
                 case_globs: tuple[str, ...] = ()) -> list[tuple[str, RunConfig, bool]]:
    """(name, config, on CUDA) of every case of a run root (a directory with a manifest: the configs it ran, on the
    device it ran on) or of a matrix (a shipped name or a YAML file: its cases, with `sets` and only those matching
    `case_globs`, as they would run on this machine, or on CUDA or not as `on_cuda` says; a CUDA case with the GPU's
    defaults for the keys nothing names, as `zbench run` gives it)."""
    from zbench.runroot.read import load_run_root, read_case_config

    path = Path(target)
    if not path.exists() and ("/" in str(target) or path.suffix in (".yaml", ".yml")):
        raise ValueError(f"{target} does not exist: give a run root (a folder with manifest.json), a shipped "
                         "matrix name (zbench matrices) or a matrix YAML file")
    if path.is_dir():
        run = load_run_root(path)
        return [(c.name, read_case_config(c.dir), run.device == "cuda") for c in run.cases]
    from zbench.harness.matrix import expand, load_matrix

    return [(c.name, c.config, c.config.trainer.uses_cuda() if on_cuda is None else on_cuda)
            for c in expand(load_matrix(str(target)), sets=sets, case_globs=case_globs, device_defaults=True,
                            on_cuda=on_cuda)]


def estimate_target(target: str | Path, on_cuda: bool | None = None, sets: tuple[tuple[str, object], ...] = (),
                    case_globs: tuple[str, ...] = ()) -> list[tuple[CaseEstimate, RunConfig, bool]]:
    """`estimate_case` of every case of `target_cases(...)`, beside the case's config and whether it runs on CUDA
    (what the activation and KV-cache terms need)."""
    base = Path(target) if Path(target).is_dir() else None
    return [(estimate_case(cfg, base_dir=base / name if base else None, name=name, on_cuda=cuda), cfg, cuda)
            for name, cfg, cuda in target_cases(target, on_cuda, sets, case_globs)]
