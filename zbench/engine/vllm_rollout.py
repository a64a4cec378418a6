"""The `vllm` rollout backend: one in-process vLLM engine per rank, colocated with the actor on its GPU.

Between rollouts the engine sleeps (level 2: weights and KV cache released), so training gets the memory back.
After every update the trained weights are pushed in by name (`trainer.sync_weights`): vLLM wakes its weight
memory, `load_weights` copies the tensors in place (Hugging Face names are accepted as they are; q/k/v and
gate/up are stacked by vLLM's own loader; a tied `lm_head` is the embedding), then the KV cache wakes and the
prefix cache starts empty. Nothing here imports vLLM until an engine is built, so the selection and version
rules are testable without it.

With `tensor_parallel_size` T > 1, T consecutive ranks run one engine sharded over their GPUs, in vLLM's
`external_launcher` mode: each rank builds the same engine inside its own process, over the process group that
DeepSpeed already opened, and vLLM forms its TP groups of consecutive ranks from it. The ranks of a group are
given the same prompts and the same seeds (the trainer sends them their group's shard), so they schedule and
sample identically; each loads the full trained tensors and keeps its own slice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import torch

from zbench.config import ConfigError
from zbench.engine.records import gpu_memory_in_use_gb

# vLLM releases pin one PyTorch release exactly; a mismatched pair fails deep inside vLLM's kernels.
TORCH_FOR_VLLM = {
    "0.26": "2.11", "0.27": "2.13", "0.28": "2.13", "0.29": "2.13", "0.30": "2.13", "0.31": "2.13", "0.32": "2.13",
    "0.33": "2.14",
}


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_vllm() -> str | None:
    """The installed vLLM version, or None."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_versions(vllm_version: str, torch_version: str) -> None:
    """Refuse a vLLM / PyTorch pair that vLLM was not built for, naming the pairs that work."""
    pairs = ", ".join(f"vLLM {v} + torch {t}" for v, t in TORCH_FOR_VLLM.items())
    want = TORCH_FOR_VLLM.get(_minor(vllm_version))
    if want is None:
        raise ConfigError("rollout.backend", f"vLLM {vllm_version} is not a tested version; tested pairs: {pairs}")
    if _minor(torch_version) != want:
        raise ConfigError("rollout.backend", f"vLLM {vllm_version} is built for torch {want}, but torch "
                                             f"{torch_version} is installed; tested pairs: {pairs}")


def select_backend(asked: str, on_cuda: bool, vllm_version: str | None, torch_version: str,
                   graph_loop: bool = False) -> str:
    """The rollout backend that will run: `auto` takes vLLM where it is installed, supported and on CUDA, unless
    the case is one where the hf backend's CUDA-graph loop was measured faster (`graph_loop`:
    `zbench.config.auto_takes_graph_loop`)."""
    if asked == "hf":
        return "hf"
    if asked == "auto":
        if not (on_cuda and vllm_version) or graph_loop:
            return "hf"
        try:
            check_versions(vllm_version, torch_version)
        except ConfigError:
            return "hf"
        return "vllm"
    if not on_cuda:
        raise ConfigError("rollout.backend", "'vllm' needs a CUDA GPU; use 'hf' (or 'auto') on this machine")
    if not vllm_version:
        raise ConfigError("rollout.backend", "'vllm' asked for but vLLM is not installed: pip install 'zbench[vllm]' "
                                             "(or use 'hf')")
    check_versions(vllm_version, torch_version)
    return "vllm"


def vllm_weights(named: Iterator[tuple[str, torch.Tensor]], tied_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face parameter names as vLLM's loader takes them: a tied `lm_head` is not sent (it *is* the
    embedding in vLLM, updated through `model.embed_tokens.weight`)."""
    for name, tensor in named:
        if tied_embeddings and name == "lm_head.weight":
            continue
        yield name, tensor


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Token lists of left-padded prompts."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


class VLLMRollout:
    """Sampling with an in-process vLLM engine; same sampling parameters as the `hf` backend."""

    backend = "vllm"
    engine = "vllm"  # the summary's rollout_engine

    def __init__(self, model_path: str, *, pad_id: int, eos_ids: list[int], max_new_tokens: int, temperature: float,
                 top_p: float, gpu_memory_utilization: float, tensor_parallel_size: int, seed: int,
                 max_model_len: int, tied_embeddings: bool, kv_cache_bytes: int | None = None,
                 enforce_eager: bool = False, log_probs: bool = False, engine_args: dict[str, Any] | None = None,
                 in_process: bool = True):
        # the engine must live in this process for the weight push; benchmarks may measure it in its own process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        self.in_process = in_process
        if tensor_parallel_size > 1:  # symmetric-memory all-reduce buffers would sit outside what sleep releases
            os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
        from vllm import LLM

        self.pad_id, self.eos_ids = pad_id, eos_ids
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.tied_embeddings = tied_embeddings
        self.log_probs = log_probs
        self.version = installed_vllm()
        self.llm = LLM(**engine_arguments(model_path, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                                          kv_cache_bytes=kv_cache_bytes, enforce_eager=enforce_eager,
                                          max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                                          extra=engine_args))
        self.model_runner = model_runner_of(self.llm)
        self.asleep = False
        self.awake_used_gb = 0.0
        self.seconds: dict[str, float] = {}  # of the last rollout: inside the engine's generate, and its sleep

    def to(self, device: torch.device | str) -> None:
        """No-op: vLLM releases its memory by sleeping, not by moving."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int,
                 sleep: bool = True) -> dict[str, torch.Tensor]:
        """One response per row (rows already repeat each prompt n times), each request seeded from `seed`; then
        the engine sleeps unless `sleep` is false. With `log_probs`, also the sampled tokens' log-probs: vLLM then
        computes a log-softmax over the vocabulary and builds a Python object per token, about a quarter of the
        rollout's time for 128 sequences of 512 tokens (benchmarks/vllm_sampling.py)."""
        from vllm import SamplingParams, TokensPrompt

        from zbench.engine.rollout import response_mask_from

        if self.asleep:  # level 2 dropped the weights: waking alone would sample from whatever the memory holds
            raise RuntimeError("the vLLM engine sleeps with its weights dropped: push weights (load_weights), which "
                               "wakes it, before generating")
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in strip_left_padding(input_ids, attention_mask)]
        params = [SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, top_k=0,
                                 max_tokens=self.max_new_tokens, seed=seed * 65_537 + i,
                                 logprobs=0 if self.log_probs else None, stop_token_ids=self.eos_ids,
                                 detokenize=False) for i in range(len(prompts))]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.seconds = {"engine": time.perf_counter() - start}
        responses = torch.full((len(outs), self.max_new_tokens), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((len(outs), self.max_new_tokens), dtype=torch.float32)
        for row, out in enumerate(outs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)[: self.max_new_tokens]
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if self.log_probs:
                logprobs[row, : len(ids)] = torch.tensor([completion.logprobs[i][t].logprob
                                                          for i, t in enumerate(ids)])
        mask = response_mask_from(responses, self.eos_ids, self.pad_id)
        self.awake_used_gb = gpu_memory_in_use_gb()  # the GPU's use with the engine awake, before it sleeps
        if sleep:
            start = time.perf_counter()
            self.sleep()  # training takes the memory back; every weight is pushed again before waking
            self.seconds["sleep"] = time.perf_counter() - start
        out = {"responses": responses, "response_mask": mask}
        if self.log_probs:
            out["rollout_log_probs"] = logprobs * mask
        return out

    def sleep(self) -> None:
        """Release the engine's weights and KV cache (level 2) unless it sleeps already."""
        if not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def _wake_kv_cache(self) -> None:
        # hand training's cached blocks back to the driver first, or both would be held at once (the peak)
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False

    @torch.no_grad()
    def load_weights(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Push trained weights into the engine (waking its weight memory first); returns the bytes pushed."""
        if not self.in_process:
            raise RuntimeError("weights can be pushed only into an in-process vLLM engine (in_process=True)")
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        pushed = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal pushed
            for name, tensor in vllm_weights(named, self.tied_embeddings):
                pushed += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.llm.apply_model(lambda model: model.load_weights(counted()))
        if self.asleep:
            self._wake_kv_cache()
        self.llm.reset_prefix_cache()
        return pushed


def model_runner_of(llm: Any) -> str | None:
    """Which of vLLM's GPU model runners an engine runs: "v2" (vLLM 0.26's default for dense, non-hybrid models
    such as Qwen3) or "v1" (`VLLM_USE_V2_MODEL_RUNNER=0`, or a feature V2 lacks), or None where this vLLM does not
    say. They sample differently: at 32 seeded rows per GPU V1 draws one `exponential_` per row and decode step,
    0.3 s slower a rollout on an H200 (results/reference/h200x2-v1-runner-20261127)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    use_v2 = getattr(config, "use_v2_model_runner", None)
    return None if use_v2 is None else ("v2" if use_v2 else "v1")


def engine_arguments(model_path: str, *, seed: int, gpu_memory_utilization: float, kv_cache_bytes: int | None,
                     enforce_eager: bool, max_model_len: int, tensor_parallel_size: int,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `LLM(...)` arguments for a colocated engine; `extra` (a benchmark's variant) adds to them or replaces
    any of them, e.g. `{"enable_prefix_caching": false}`."""
    args: dict[str, Any] = {
        "model": model_path, "runner": "generate", "dtype": "bfloat16", "seed": seed,
        "gpu_memory_utilization": gpu_memory_utilization, "kv_cache_memory_bytes": kv_cache_bytes,
        "enforce_eager": enforce_eager, "enable_sleep_mode": True, "max_model_len": max_model_len,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",  # log-probs of the distribution actually sampled
        **parallel_args(tensor_parallel_size)}
    return {**args, **(extra or {})}


def parallel_args(tensor_parallel_size: int) -> dict[str, Any]:
    """vLLM engine arguments for a colocated engine spanning `tensor_parallel_size` ranks (one GPU each)."""
    if tensor_parallel_size == 1:
        return {"tensor_parallel_size": 1}  # in-process, single GPU
    return {"tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "external_launcher",  # every rank is its own launcher
            # the custom all-reduce maps peers to local CUDA devices; each rank here sees only its own GPU
            "disable_custom_all_reduce": True}


KV_BLOCK_TOKENS = 16  # vLLM's default block size on CUDA: a sequence holds whole blocks


def kv_bytes_per_token(model_config: Any, tensor_parallel_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token takes on one GPU of an engine: keys and values of every layer, for the
    key/value heads this GPU holds (heads are split over the TP group, or replicated when there are fewer)."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * -(-heads // tensor_parallel_size) * head_dim * dtype_bytes


def fitted_kv_cache_bytes(model_config: Any, sequences: int, max_model_len: int, tensor_parallel_size: int) -> int:
    """A KV cache that holds `sequences` sequences of `max_model_len` tokens at once (whole blocks each, and the
    one block vLLM's pool keeps for itself), with 5% to spare: one rollout never waits for cache, and no more
    memory is taken than it can use."""
    blocks = sequences * -(-max_model_len // KV_BLOCK_TOKENS) + 1
    return int(blocks * KV_BLOCK_TOKENS * kv_bytes_per_token(model_config, tensor_parallel_size) * 1.05)


def build(model_path: str, cfg: Any, pad_id: int, eos_ids: list[int], rank: int, tied_embeddings: bool,
          engine_args: dict[str, Any] | None = None, in_process: bool = True) -> VLLMRollout:
    """A VLLMRollout for a case config on one rank (`engine_args`, `in_process`: further vLLM engine arguments and
    the engine in a process of its own, for benchmarks)."""
    r = cfg.rollout
    max_model_len = cfg.data.max_prompt_length + r.max_new_tokens
    kv_cache_bytes = None
    if r.kv_cache_fit:
        from transformers import AutoConfig

        sequences = cfg.batch_plan().sequences_per_rank * r.tensor_parallel_size  # one engine's share of a rollout
        kv_cache_bytes = fitted_kv_cache_bytes(AutoConfig.from_pretrained(model_path), sequences, max_model_len,
                                               r.tensor_parallel_size)
    return VLLMRollout(model_path, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=r.max_new_tokens,
                       temperature=r.temperature, top_p=r.top_p, gpu_memory_utilization=r.gpu_memory_utilization,
                       tensor_parallel_size=r.tensor_parallel_size,
                       seed=cfg.seed * 1_000 + rank // r.tensor_parallel_size,  # one seed per TP group
                       max_model_len=max_model_len, tied_embeddings=tied_embeddings, kv_cache_bytes=kv_cache_bytes,
                       enforce_eager=r.enforce_eager, log_probs=r.log_probs, engine_args=engine_args,
                       in_process=in_process)
