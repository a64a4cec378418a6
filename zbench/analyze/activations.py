"""Predicted memory of a case's batch geometry: the activation, logit and KV-cache terms that `memory.py`'s ZeRO
model-state figures leave out, and the two together as one rank's peak.

The terms are upper bounds at full length (every sequence `data.max_prompt_length + rollout.max_new_tokens` tokens):

- a training micro-batch of b sequences keeps, per decoder layer and token, its inputs to the norms, the q/k/v/o
  projections and the SwiGLU MLP (about 4h + 4q + 2kv + 4i elements at training precision); with activation
  checkpointing only each layer's input (h) stays, plus one layer recomputed at a time; a compiled layer under
  an activation budget (`model.activation_memory_budget`) keeps its input and the budget's share of the rest
  (`budget_share`), plus one layer's working set for the recomputation in its backward;
- the actor's head makes fp32 logits and their log-softmax over the vocabulary (2 x 4 bytes per token and entry),
  in the training passes and in the gradient-free ones (log-probs of the actor and reference) alike: for the whole
  micro-batch, or with `model.fused_head` for one chunk of `zbench.engine.lm_head.DEFAULT_CHUNK_TOKENS` at most;
- vLLM's KV cache: fitted to one rollout (`rollout.kv_cache_fit`, as `zbench.engine.vllm_rollout` sizes it), or the
  share `rollout.gpu_memory_utilization` of the device;
- the hf backend's CUDA-graph decode loop (`rollout.cuda_graph`, a replica that stays on the GPU): its static KV
  cache, every row of a rank at the widest prompt plus `rollout.max_new_tokens`, given back after each rollout as
  vLLM's is (`rollout.release_kv_cache`), or else held through training.

What no formula holds (the CUDA context, allocator slack, the runtime's own buffers, a CPU process's interpreter
and libraries), and how far the full-length bound is from the sequences a case really trains on, the tuner measures
on the case's trials and calibrates the model with (`zbench.harness.tune_search.calibrate`), phase by phase
(`GeometryMemory.gen_bytes`, `train_bytes`) where a GPU measures phases.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

from zbench.analyze.memory import BYTES_PER_PARAM, GIB, estimate_case
from zbench.analyze.model_size import model_config
from zbench.config import RunConfig, kv_cache_released, rollout_engine, with_overrides
from zbench.engine.batches import PROMPT_WIDTH_MULTIPLE, aligned
from zbench.engine.lm_head import DEFAULT_CHUNK_TOKENS

LOGIT_BYTES = 2 * 4  # fp32 logits and their log-softmax, per token and vocabulary entry


@dataclass(frozen=True, slots=True)
class GeometryMemory:
    """One rank's predicted bytes at a batch geometry, by part."""

    states: int  # ZeRO model states, reference and rollout replica (zbench.analyze.memory.estimate_case)
    training: int  # the largest training micro-batch's activations and logits
    forward: int  # the largest gradient-free micro-batch's logits and one layer's working set
    kv_cache: int  # the rollout's KV cache on this rank, given back before training (vLLM's, the graph loop's)
    critic: int = 0  # on a GPU, the critic's largest pass, which its process keeps cached through the others
    held_kv: int = 0  # the graph loop's static KV cache, held through training

    @property
    def peak_bytes(self) -> int:
        """States, the critic's cached pass, and the largest of the terms that come one after another: the
        training micro-batch, the gradient-free one, and vLLM's KV cache, which the engine releases (sleeping)
        before training takes the memory back (measured: `perf/device_memory_gen_gb` against
        `perf/device_memory_train_gb`).

        The critic trains in a process of its own, whose allocator keeps the blocks of its largest pass while the
        actor trains and vLLM generates: measured on 2 x H200 at the reference PPO config, each decoder layer that
        keeps its activations added about 2.8 GB to the training phase, actor and critic together, and the
        generation phase grew by the critic's share (results/reference/h200x2-ppo-20261126).

        The graph loop's KV cache is recorded into its CUDA graph by address: given back after each rollout at
        those addresses (`rollout.release_kv_cache`) it is `kv_cache`, else it stays allocated while the model
        trains (`held_kv`)."""
        return max(self.gen_bytes, self.train_bytes)

    @property
    def gen_bytes(self) -> int:
        """What the rollout phase holds: what stays through every phase, and the rollout's KV cache."""
        return self.states + self.critic + self.held_kv + self.kv_cache

    @property
    def train_bytes(self) -> int:
        """What the training phase holds: what stays through every phase, and the larger of the training and the
        gradient-free micro-batch (one process runs them one after the other, its allocator keeping the larger)."""
        return self.states + self.critic + self.held_kv + max(self.training, self.forward)

    @property
    def peak_gb(self) -> float:
        """`peak_bytes` in GiB, as the engine reports memory."""
        return self.peak_bytes / GIB


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The dimensions of a decoder that size its activations and KV cache, read from the model's own config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def model_dims(spec: str) -> ModelDims:
    """`ModelDims` of `model.path` (an embedded, packaged or local model), from its transformers config."""
    c = model_config(spec)
    heads = int(c.num_attention_heads)
    return ModelDims(vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size), num_layers=int(c.num_hidden_layers),
                     num_heads=heads, num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                     head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                     intermediate_size=int(c.intermediate_size))


# The share of a decoder layer's activations above its input that a compiled layer keeps at each activation budget:
# measured on an H200 (Qwen3-0.6B shape, bf16, micro-batch 32 of GRPO's sequences, compiled by Inductor), peak
# memory above every layer checkpointed over the same at a budget of 1 (results/reference/h200x2-activation-budget-
# 20261128), rounded up to the hundredth. The partitioner keeps a little more than the budget says; between the
# points, linear.
KEPT_BY_BUDGET = ((0.0, 0.0), (0.15, 0.22), (0.3, 0.37), (0.5, 0.56), (1.0, 1.0))


def budget_share(budget: float) -> float:
    """The share of a layer's activations above its input that a compiled layer keeps at `budget`
    (`KEPT_BY_BUDGET`, linear between its points)."""
    for (b0, k0), (b1, k1) in itertools.pairwise(KEPT_BY_BUDGET):
        if budget <= b1:
            return k0 + (k1 - k0) * (budget - b0) / (b1 - b0)
    return 1.0


def _layer_elements(d: ModelDims) -> int:
    """Activation elements one decoder layer keeps per token for its backward."""
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    return 4 * d.hidden_size + 4 * q + 2 * kv + 4 * d.intermediate_size


def geometry_memory(cfg: RunConfig, on_cuda: bool, device_bytes: int = 0, dims: ModelDims | None = None
                    ) -> GeometryMemory:
    """Predicted per-rank memory of `cfg` at its batch geometry; `device_bytes` (a GPU's total) sizes vLLM's share."""
    d = dims or model_dims(cfg.model.path)
    precision = cfg.model.precision(on_cuda)
    p = BYTES_PER_PARAM[precision][0]
    est = estimate_case(cfg, on_cuda=on_cuda)
    states = est.gpu_bytes if on_cuda else est.gpu_bytes + est.cpu_bytes
    seq = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    layer = _layer_elements(d) * p

    def logits(b: int) -> int:
        tokens = b * seq if not cfg.model.fused_head else min(b * seq, DEFAULT_CHUNK_TOKENS)
        return tokens * d.vocab_size * LOGIT_BYTES

    ckpt = cfg.model.gradient_checkpointing
    recomputed = min(d.num_layers, cfg.model.checkpoint_layers if cfg.model.checkpoint_layers is not None
                     else d.num_layers) if ckpt else 0

    budget = cfg.model.activation_memory_budget if cfg.model.compiles_layers(on_cuda) else 1.0
    kept_layer = d.hidden_size * p + budget_share(budget) * (layer - d.hidden_size * p)

    def train(b: int, with_logits: bool) -> int:
        kept = int(seq * b * (recomputed * d.hidden_size * p + (d.num_layers - recomputed) * kept_layer))
        working = seq * b * layer if recomputed or budget < 1.0 else 0
        return kept + working + (logits(b) if with_logits else 0)

    training = train(cfg.actor.micro_batch_size_per_gpu, True)
    forward_actor = cfg.actor.forward_micro_batch_size_per_gpu or cfg.actor.micro_batch_size_per_gpu
    forward = forward_actor * seq * layer + logits(forward_actor)
    critic = 0
    if cfg.needs_critic:
        forward_critic = cfg.critic.forward_micro_batch_size_per_gpu or cfg.critic.micro_batch_size_per_gpu
        critic_training = train(cfg.critic.micro_batch_size_per_gpu, False)
        critic_forward = forward_critic * seq * layer
        if on_cuda:
            critic = max(critic_training, critic_forward)
        else:  # a host allocator gives large blocks back: the critic's passes take turns with the actor's
            training, forward = max(training, critic_training), max(forward, critic_forward)
    kv = 0
    if rollout_engine(cfg, on_cuda) == "vllm":
        r = cfg.rollout
        if r.kv_cache_fit:  # sized as the engine sizes it, from the dims a Hugging Face config would give
            from zbench.engine.vllm_rollout import fitted_kv_cache_bytes

            shape = SimpleNamespace(num_hidden_layers=d.num_layers, num_attention_heads=d.num_heads,
                                    num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
                                    hidden_size=d.hidden_size)
            sequences = cfg.batch_plan().sequences_per_rank * r.tensor_parallel_size
            kv = fitted_kv_cache_bytes(shape, sequences, seq, r.tensor_parallel_size)
        else:
            kv = int(r.gpu_memory_utilization * device_bytes)
    held = 0
    if rollout_engine(cfg, on_cuda) == "hf-graph":
        width = aligned(cfg.data.max_prompt_length, PROMPT_WIDTH_MULTIPLE) + cfg.rollout.max_new_tokens
        loop_kv = cfg.batch_plan().sequences_per_rank * width * 2 * d.num_layers * d.num_kv_heads * d.head_dim * p
        if kv_cache_released(cfg):  # given back after each rollout, as a sleeping vLLM's
            kv = loop_kv
        else:
            held = loop_kv
    if not on_cuda:  # every rank's states and passes live in the one host's memory
        ranks = cfg.trainer.world_size
        return GeometryMemory(states=states * ranks, training=training * ranks, forward=forward * ranks, kv_cache=0)
    return GeometryMemory(states=states, training=training, forward=forward, kv_cache=kv, critic=critic, held_kv=held)


def largest_fitting_micro(cfg: RunConfig, checkpointing: bool, device_bytes: int, dims: ModelDims | None = None
                          ) -> int | None:
    """The largest training micro-batch (a divisor of a rank's share of a mini-batch; gradient-free passes at the
    same size) at which `cfg`, with activation checkpointing on or off, is predicted to fit a GPU of `device_bytes`;
    None when not even one sequence does (the model states and KV cache leave no room). Off means every layer keeps
    all of its activations (an activation budget of 1), whatever budget `cfg` has."""
    d = dims or model_dims(cfg.model.path)
    per_rank = cfg.batch_plan().mini_batch_sequences // cfg.trainer.world_size
    roles = ("actor", "critic") if cfg.needs_critic else ("actor",)
    for micro in sorted((m for m in range(1, per_rank + 1) if per_rank % m == 0), reverse=True):
        geometry = {"model.gradient_checkpointing": checkpointing, "model.checkpoint_layers": None,  # every layer
                    "model.activation_memory_budget": 1.0,
                    **{f"{r}.micro_batch_size_per_gpu": micro for r in roles},
                    **{f"{r}.forward_micro_batch_size_per_gpu": micro for r in roles}}
        if geometry_memory(with_overrides(cfg, geometry), True, device_bytes, d).peak_bytes <= device_bytes:
            return micro
    return None
