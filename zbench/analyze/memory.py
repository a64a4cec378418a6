"""Predicted model-state memory of a case, per rank, from the ZeRO formulas, before anything runs.

Bytes per parameter (Rajbhandari et al., "ZeRO", 2020), with Adam:

    precision   params  grads  optimizer (fp32 master + Adam m, v)
    bf16 mixed       2      2     12
    fp32             4      4      8

Stage 1 partitions the optimizer states over the data-parallel ranks, stage 2 also the gradients, stage 3
also the parameters. Offload moves the optimizer states (and at stage 3 the parameters) to CPU or NVMe.
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

import json
from dataclasses import dataclass
from pathlib import Path

from zbench.config import RunConfig, effective_offload

GIB = 2**30


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The dimensions of a Qwen3-architecture decoder, enough to count its parameters."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = True


MODEL_DIMS: dict[str, ModelDims] = {
    "tiny": ModelDims(vocab_size=502, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=192, tie_word_embeddings=True),
    "qwen3-0.6b": ModelDims(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
                            num_kv_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
}

# Bytes per parameter: (params, grads, optimizer states).
BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def resolve_model_dims(model: str, base_dir: Path | None = None) -> ModelDims:
    """Dims of a named model ("tiny", "qwen3-0.6b") or of a local Hugging Face directory's config.json."""
    if model in MODEL_DIMS:
        return MODEL_DIMS[model]
    path = Path(model)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"model.path {model!r}: not one of {sorted(MODEL_DIMS)} and no config.json in {path}")
    c = json.loads(config.read_text())
    heads = int(c["num_attention_heads"])
    return ModelDims(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        intermediate_size=int(c["intermediate_size"]),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def _layer_modules(d: ModelDims) -> list[int]:
    """Parameter counts of the modules of one decoder layer (Qwen3: no biases, q/k RMSNorm per head)."""
    h, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    return [
        h * q, h * kv, h * kv, q * h,  # q, k, v, o projections
        d.head_dim, d.head_dim,  # q_norm, k_norm
        h * d.intermediate_size, h * d.intermediate_size, d.intermediate_size * h,  # gate, up, down
        h, h,  # input and post-attention RMSNorm
    ]


def param_count(d: ModelDims) -> int:
    """Number of parameters, tied embeddings counted once (as ``sum(p.numel())`` counts them)."""
    embed = d.vocab_size * d.hidden_size
    lm_head = 0 if d.tie_word_embeddings else embed
    return embed + d.num_layers * sum(_layer_modules(d)) + d.hidden_size + lm_head


def largest_layer_params(d: ModelDims) -> int:
    """Parameters of the largest single module: what ZeRO-3 gathers at once (DeepSpeed's definition)."""
    return max(d.vocab_size * d.hidden_size, *_layer_modules(d))


@dataclass(frozen=True, slots=True)
class Placement:
    """Bytes per rank of one trained model's states, by where they live."""

    gpu: int = 0
    cpu: int = 0
    nvme: int = 0


def model_states(n_params: int, largest_layer: int, stage: int, offload: str, dp: int,
                 precision: str = "bf16") -> Placement:
    """Per-rank bytes of parameters, gradients and optimizer states of one model trained with ZeRO."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.stage must be 0..3, got {stage}")
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, got {precision!r}")
    p_b, g_b, o_b = BYTES_PER_PARAM[precision]
    params = n_params * p_b / (dp if stage >= 3 else 1)
    grads = n_params * g_b / (dp if stage >= 2 else 1)
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


def estimate_case(cfg: RunConfig, model_dims: ModelDims | None = None, base_dir: Path | None = None,
                  name: str = "", on_cuda: bool | None = None) -> CaseEstimate:
    """Predict one case's per-rank memory from its config, at the precision the engine trains it in: on CUDA or
    not as ``on_cuda`` says (a run that already ran), else as it would run on this machine."""
    dims = model_dims or resolve_model_dims(cfg.model.path, base_dir)
    stage, offload, dp = cfg.zero.stage, cfg.zero.offload, cfg.trainer.world_size
    precision = cfg.model.precision(cfg.trainer.uses_cuda() if on_cuda is None else on_cuda)
    n, largest = param_count(dims), largest_layer_params(dims)
    actor = model_states(n, largest, stage, offload, dp, precision)
    critic = model_states(n, largest, stage, offload, dp, precision) if cfg.needs_critic else None
    copy = n * BYTES_PER_PARAM[precision][0]
    eff = effective_offload(stage, offload).label
    return CaseEstimate(
        case=name, algorithm=cfg.algorithm, stage=stage, offload=offload,
        offload_effective=eff, world_size=dp, precision=precision, n_params=n, actor=actor, critic=critic,
        reference_bytes=copy, replica_bytes=copy, replica_on_gpu=eff == "none",
    )
