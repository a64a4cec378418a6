"""Rollout: sampling responses from a generation replica of the actor, and syncing trained weights into it.

The `hf` backend keeps a plain transformers copy of the actor on each rank. After every update the trained
weights are copied in (`sync_weights`): under ZeRO-0..2 every rank holds full parameters; under ZeRO-3 they are
gathered bucket by bucket so that no more than `bucket_mb` of extra memory is ever materialised.

It samples in one of three ways: transformers `generate` with a dynamic cache, the same with a static cache, or
`GraphDecoder`, zbench's own loop over a static cache whose decode step is captured once as a CUDA graph and
replayed for every token (no per-token host syncs, no Python between kernels), with the replica's q/k/v and gate/up
projections merged into one matrix multiply each (`zbench.engine.merged_projections`). Its one-token steps attend the
grouped key/value heads directly rather than through copies of the whole cache: with SDPA over the whole static
cache (`gqa_decode_attention`), or with zbench's Triton kernels, which read only the positions each row attends
(`gqa_decode_attention_skipping`, `zbench.engine.decode_attention`; `rollout.decode_attention`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zbench.engine import device_memory
from zbench.engine.batches import PROMPT_WIDTH_MULTIPLE, aligned
from zbench.engine.profiling import part
from zbench.engine.records import gpu_memory_in_use_gb

GQA_DECODE = "zbench_gqa_decode"
GQA_DECODE_SKIPPING = "zbench_gqa_decode_skipping"
# the forward keyword that tells the Triton attention which runs of rows share their prompt's keys: (rows, columns)
SHARED_PREFIX = "zbench_shared_prefix"
DECODE_ATTENTION = ("sdpa", "triton")  # GraphDecoder's one-token attention: the whole cache, or the masked-in part


def response_mask_from(responses: torch.Tensor, eos_ids: list[int], pad_id: int) -> torch.Tensor:
    """1 for response tokens up to and including the first EOS, 0 after it (and for padding)."""
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= responses == eos
    # tokens strictly after the first EOS are padding
    after_eos = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0
    return (~after_eos).long()


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else softmax(logits / T) restricted to the top-p nucleus
    (as transformers' `TopPLogitsWarper`: the smallest set whose probability reaches `top_p`, at least one token),
    sampled by the exponential race argmax(p / E), E ~ Exp(1), which draws exactly from p with no host sync."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


def _one_token_step(module: nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether an attention call is a plain one-token decode step: one query position, inference, and none of a
    position bias, attention sinks, softcapping or returned attention weights (left to transformers' SDPA)."""
    # a position bias and attention sinks are tensors (no truth value); softcap and output_attentions plain values
    extra = (kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None or bool(kwargs.get("softcap"))
             or bool(kwargs.get("output_attentions")))
    return query.shape[2] == 1 and not extra and not module.training


def gqa_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for a one-token query under grouped-query attention: its query heads
    are folded onto their key/value head, (B, H, 1, D) -> (B, H_kv, H / H_kv, D), so each cached key and value is
    read once. transformers itself does this only outside torch.compile; inside (the recorded decode step) it
    expands the whole cache `H / H_kv` times every token, which at 64 rows x 1k positions is most of the step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if not _one_token_step(module, query, kwargs) or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups, dim)
    # the mask is (B, 1, 1, L) or None: it broadcasts over the folded heads
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"))
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def gqa_decode_attention_skipping(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`gqa_decode_attention`, except that a one-token query under a boolean mask runs `decode_attention`'s Triton
    kernels, which read only the cache positions the mask keeps (SDPA reads the whole static cache every token)."""
    from zbench.engine.decode_attention import decode_attention, supports

    # the mask says which positions a row attends, a sliding window's included; a float (additive) mask or none
    # at all, or heads the kernels do not take, stay with SDPA
    one_mask_row = (attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4
                    and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1)
    fits = supports(query.shape[-1], value.shape[-1], query.element_size())
    if not _one_token_step(module, query, kwargs) or not one_mask_row or not fits:
        return gqa_decode_attention(module, query, key, value, attention_mask, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scale = kwargs.get("scaling") or dim ** -0.5
    # runs of rows with one prompt read its keys once (GraphDecoder passes it where its prefill made them equal)
    share, prefix = kwargs.get(SHARED_PREFIX) or (1, 0)
    # a mask made once for the whole batch broadcasts over the rows, as it would in SDPA
    out = decode_attention(folded, key, value, attention_mask[:, 0, 0, :].expand(batch, -1), float(scale),
                           share, prefix)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_gqa_decode_attention(model: nn.Module, attention: str = "sdpa") -> None:
    """Register zbench's decode attentions with transformers (masks as for SDPA) and switch `model` to the one
    `attention` names: `sdpa` (`gqa_decode_attention`) or `triton` (`gqa_decode_attention_skipping`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if attention not in DECODE_ATTENTION:
        raise ValueError(f"decode attention {attention!r}: choose one of {', '.join(DECODE_ATTENTION)}")
    for name, fn in ((GQA_DECODE, gqa_decode_attention), (GQA_DECODE_SKIPPING, gqa_decode_attention_skipping)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(GQA_DECODE if attention == "sdpa" else GQA_DECODE_SKIPPING)


def resolve_decode_attention(asked: str, device: torch.device, config: Any, dtype: torch.dtype) -> str:
    """`rollout.decode_attention` as it will run on `device` for a model of this transformers `config` in `dtype`:
    `auto` takes the Triton kernels on a CUDA device where they compute the model's attention, else SDPA;
    `triton` where they cannot is an error that says why (on a CPU it needs Triton's interpreter,
    `TRITON_INTERPRET=1`, which `auto` never picks)."""
    from zbench.engine import decode_attention

    why_not = decode_attention.unsupported(config, dtype)
    if asked == "auto":
        runs = device.type == "cuda" and decode_attention.available(device)
        return "triton" if runs and why_not is None else "sdpa"
    if asked == "triton":
        if not decode_attention.available(device):
            where = "Triton is not installed" if decode_attention.triton is None else f"the rollout runs on {device.type}"
            raise RuntimeError(f"rollout.decode_attention=triton: its kernels cannot run here ({where}; they need a "
                               "CUDA device and PyTorch's Triton); use sdpa or auto")
        if why_not is not None:
            raise RuntimeError(f"rollout.decode_attention=triton: the kernels do not compute this model's attention "
                               f"({why_not}); use sdpa or auto")
    return asked


def one_prompt_width(longest: int | None, compiled: bool, attention: str | None) -> int | None:
    """The width the graph loop pads every batch of prompts to, or None where it keeps the width each batch comes
    with (the trainer's buckets, multiples of `PROMPT_WIDTH_MULTIPLE`).

    The compiled loop records its decode step once per (rows, cache length), 35-47 s on an H200. The Triton attention
    skips left padding, so there every batch is padded to the longest prompt a case admits (`longest`), rounded up
    to a multiple of `PROMPT_WIDTH_MULTIPLE`: a run records once, and its largest cache is allocated by the first
    rollout, at a cost of 3-4 % of a rollout (results/reference/h200x2-merged-projections-20261127). With SDPA,
    which reads the whole cache, and in the eager loop (a parked replica, a CPU), which records nothing, widths stay
    as they come."""
    if not longest or not compiled or attention != "triton":
        return None
    return aligned(longest, PROMPT_WIDTH_MULTIPLE)


@dataclasses.dataclass
class LoopState:
    """What the graph loop's recorded step (`GraphDecoder._step`) reads and changes besides the mask and the cache,
    at addresses fixed for a (rows, cache length): the token it feeds and its position, the mask column it opens,
    the step counter and seed its draw reads, the rows done, the EOS ids and the responses so far."""

    token: torch.Tensor  # (B, 1) int64
    position: torch.Tensor  # (B, 1) int64
    column: torch.Tensor  # (1,) int64: the mask column of the token fed
    step: torch.Tensor  # (1,) int64: the index of the token drawn last
    seed: torch.Tensor  # (1,) int64
    done: torch.Tensor  # (B,) bool
    eos: torch.Tensor  # (E,) int64
    responses: torch.Tensor  # (B, new tokens) int64

    @classmethod
    def allocate(cls, batch: int, new_tokens: int, eos_ids: list[int], device: torch.device) -> LoopState:
        one = functools.partial(torch.zeros, dtype=torch.long, device=device)
        return cls(token=one(batch, 1), position=one(batch, 1), column=one(1), step=one(1), seed=one(1),
                   done=torch.zeros(batch, dtype=torch.bool, device=device),
                   eos=torch.tensor(eos_ids, dtype=torch.long, device=device), responses=one(batch, new_tokens))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def chain_lengths(steps: int, per_graph: int) -> list[int]:
    """How `steps` decode steps split into runs of `per_graph` captured as one CUDA graph each: full runs, then what
    is left (`GraphDecoder.steps_per_graph`); a graph never runs past the last step, whose responses end there."""
    full, rest = divmod(steps, per_graph)
    return [per_graph] * full + ([rest] if rest else [])


def chained_schedule(tokens: int, sync_every: int, per_graph: int) -> list[tuple[int, bool, list[int]]]:
    """How the in-graph loop runs its decode steps 1 .. `tokens` - 1 (step t draws token t) `per_graph` to a CUDA
    graph: entries (first step, whether the host checks for all rows done before it, the runs' lengths). Step 1 runs
    alone (the compiled step as it is); each later entry ends before the next multiple of `sync_every` or at the
    last step, and the host checks before an entry whose first step is such a multiple: before the steps where one
    step a replay checks, so both stop after the same steps and leave the same cache and loop state behind.
    `sync_every` is at least 1 (`GraphDecoder` refuses less)."""
    schedule, t = [], 2
    if tokens >= 2:
        schedule.append((1, 1 % sync_every == 0, [1]))
    while t < tokens:
        end = min(tokens, (t // sync_every + 1) * sync_every)
        schedule.append((t, t % sync_every == 0, chain_lengths(end - t, per_graph)))
        t = end
    return schedule


def inductor_has_pdl() -> bool:
    """Whether this torch's Inductor can compile its Triton kernels for programmatic dependent launch."""
    import torch._inductor.config as inductor

    return hasattr(inductor.triton, "enable_pdl")


def plain_static_layers(config: Any) -> bool:
    """Whether transformers' static cache for this model is all plain `StaticLayer`s (no sliding window, indexer
    keys or recurrent state), whose keys and values `GraphDecoder` can place itself."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    layers = getattr(StaticCache(config=config, max_cache_len=1), "layers", [])  # allocates nothing before a write
    return bool(layers) and all(type(layer) is StaticLayer for layer in layers)


# how the decode step is compiled: both record it as a CUDA graph; max-autotune also times Triton's matrix-multiply
# templates against cuBLAS for each of the step's shapes (and tunes its other kernels) while it compiles
COMPILE_MODES = ("reduce-overhead", "max-autotune")


def _call_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's own call, skipping its `_compiled_call_impl`: what `GraphDecoder`'s prefill compiles."""
    return layer._call_impl(*args, **kwargs)


class GraphDecoder:
    """Sampling loop over a static KV cache whose one-token decode step is compiled with
    `torch.compile(mode="reduce-overhead")`, i.e. recorded once as a CUDA graph per (batch, cache length, and for
    the in-graph draw the temperature, pad id and EOS ids: one each a run) and replayed for every new token. The
    prefill runs each distinct prompt once (`_prefill`), on CUDA through compiled decoder layers
    (`compile_prefill`, `_layers_compiled`); where the rows come as runs of `samples` rows of one prompt (GRPO's
    n), the Triton attention then reads that prompt's keys once a run (the recorded step is then one per run length
    too). Compiled, with top_p 1, the recorded step also draws the next token and keeps the books
    (`_step`, `race_sampling`), so a token costs the host one graph replay; otherwise sampling runs between replays
    on the device with a seeded generator (`sample_tokens`). The host checks for all-finished rows only every
    `sync_every` tokens. With `compile=False` (CPU) the same loop runs eagerly, which is how it is tested against
    `generate`. `compile_mode` max-autotune (`COMPILE_MODES`) was slower at GRPO's 128 rows on an H200: 1.83 against
    1.70 s a rollout, its kernels 0.13 s slower in all, of which its matrix-multiply templates about 0.04 s
    (results/reference/h200x2-final-20261128).

    Prompts arrive left-padded; the cache length is the prompt width plus `max_new_tokens`, so callers should pad
    prompt widths to one width (`HFRollout` does, see `one_prompt_width`) or a few buckets (the trainer's multiple
    of 64) to bound the number of recordings.

    With `release_cache`, the KV cache's memory goes back after each rollout (`free_cache`). Compiled, its pages are
    unmapped and mapped again at the same addresses before the next rollout, so the recorded graphs replay over them
    (`zbench.engine.device_memory`, on CUDA over transformers' plain static layers); where that cannot be, it is
    held, as a cache allocated anew would make the step record again. Run eagerly, the cache is dropped and
    allocated again.
    """

    def __init__(self, model: nn.Module, *, compile: bool, sync_every: int = 64, attention: str = "sdpa",
                 merge: bool = True, sample_in_graph: bool = True, release_cache: bool = False,
                 compile_mode: str = "reduce-overhead", steps_per_graph: int = 1, compile_prefill: bool | None = None,
                 prefill_backend: Any = "inductor"):
        from zbench.engine.merged_projections import merge_projections

        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode {compile_mode!r}: one of {', '.join(COMPILE_MODES)}")
        if steps_per_graph < 1:
            raise ValueError(f"steps_per_graph {steps_per_graph}: the decode steps one CUDA graph holds, at least 1")
        if sync_every < 1:
            raise ValueError(f"sync_every {sync_every}: tokens between checks for all rows done, at least 1")

        use_gqa_decode_attention(model, attention)
        self.attention = attention
        # q/k/v and gate/up as one matrix multiply each (in place; the weights keep their names for loading)
        self.merged_projections = merge_projections(model) if merge else 0
        self.model = model
        self.compile = compile
        self.sync_every = sync_every
        # the recorded step draws its token and keeps the books too (`race_sampling`), where top_p does not cut
        from zbench.engine.decode_attention import available, pdl_applies

        device = next(model.parameters()).device
        self.sample_in_graph = sample_in_graph and compile and (device.type != "cuda" or available(device))
        self._cache_slot: tuple[tuple[int, ...], Any, torch.Tensor, LoopState] | None = None
        # the cache's pages given back and mapped again at the same addresses (else, released, the cache is dropped)
        maps = release_cache and compile and device_memory.available(device)
        self.cache_at_fixed_addresses = maps and plain_static_layers(model.config)
        # a recorded step over a cache dropped and allocated anew would record again each rollout: it holds it
        self.release_cache = release_cache and (not compile or self.cache_at_fixed_addresses)
        if release_cache and not self.release_cache:
            why = ("its device cannot map memory at fixed addresses (zbench.engine.device_memory.available)"
                   if not maps else
                   "its model's static cache is not all transformers' plain StaticLayer (a sliding window, indexer "
                   "keys, a recurrent state)")
            print(f"[zbench] warning: rollout.release_kv_cache: the graph loop holds its KV cache through training, "
                  f"as {why}; the memory estimates count it as given back", flush=True)
        # the current cache's keys and values where they live at fixed addresses, else None
        self._cache_memory: Any = None
        self.wake_seconds = 0.0  # the last rollout's mapping of its cache's pages again (0: none needed)
        # the last rollout's runs of rows that read their prompt's keys once: (rows a run, prompt columns), (1, 0)
        self.shared_prefix: tuple[int, int] = (1, 0)
        self._decode = self._forward
        self._decode_and_draw = self._step
        self.device = device
        # Inductor's kernels of the step launched early and waiting, as the attention's are (`decode_attention.PDL`)
        self.pdl = compile and attention == "triton" and pdl_applies(device) and inductor_has_pdl()
        # the in-graph draw's steps captured n at a time (`rollout.steps_per_graph`; 1: torch.compile records each),
        # on CUDA, where every step's position lives in device tensors: a sliding window's layer counts on the host,
        # which a replay would not advance
        chains = (steps_per_graph > 1 and self.sample_in_graph and device.type == "cuda"
                  and plain_static_layers(model.config))
        self.steps_per_graph = steps_per_graph if chains else 1
        # the captured runs of steps, by (what the cache slot is for, the step's constants, steps), their memory, and
        # the stream that runs a rollout's first step and captures: its cuBLAS workspace then lives outside the pool
        self._chains: dict[tuple[Any, ...], torch.cuda.CUDAGraph] = {}
        self._chain_pool: Any = None
        self._chain_stream: Any = None
        # The prefill's decoder layers compiled too (None: on CUDA, where the decode step is compiled; on a CPU,
        # Inductor's C++ build costs more than a test's few prefills save): `_layers_compiled`. Only where the
        # prefill writes transformers' plain static layers (else it runs the eager fallback of `_prefill`) and the
        # model keeps its decoder layers in `model.layers`.
        if compile_prefill is None:
            compile_prefill = compile and device.type == "cuda"
        layers = getattr(getattr(model, "model", None), "layers", None)
        compiles = compile_prefill and isinstance(layers, nn.ModuleList) and plain_static_layers(model.config)
        self._prefill_layers: list[nn.Module] = list(layers) if compiles else []
        # (torch.compile imports dynamo: only where it will run)
        self._prefill_layer = torch.compile(_call_layer, dynamic=True, backend=prefill_backend) if compiles else None
        if compile:
            from torch import _inductor

            options = _inductor.list_mode_options(compile_mode) | ({"triton.enable_pdl": True} if self.pdl else {})
            self._decode = torch.compile(self._forward, options=options, dynamic=False)
            if self.steps_per_graph > 1:  # compiled, not recorded: `_replay_chained` captures runs of it
                options = options | {"triton.cudagraphs": False}
            self._decode_and_draw = torch.compile(self._step, options=options, dynamic=False)

    @property
    def prefill_compiled(self) -> bool:
        """Whether the prefill runs the decoder layers compiled (`_layers_compiled`)."""
        return bool(self._prefill_layers)

    @contextlib.contextmanager
    def _layers_compiled(self, caches: list[Any]) -> Iterator[None]:
        """Inside this block each decoder layer runs through one compiled graph shared by all of them (shapes
        dynamic: every width and prompt count above one too), writing its keys and values into its own cache of
        `caches`.

        Eager, a Qwen3-0.6B layer's prefill runs about 75 kernels (its norms in float32, the rotary embedding's and
        the cache's concatenations), about half the prefill's GPU time at GRPO's 32 prompts on an H200; compiled,
        Inductor fuses them around the matrix multiplies and the attention (46 against 83 ms a prefill,
        results/reference/h200-prefill-compiled-20261202). One layer's graph, not the whole model's: that compiles
        in seconds, not minutes. For every layer to pass the same guards, each is handed a cache of its own in place
        of the model's, and its modules' `layer_idx` reads 0 while the block lasts: in Llama- and Qwen-style
        decoders it only picks the layer's slot in a cache. Dynamic shapes still specialise sizes 0 and 1 (one
        distinct prompt compiles a second graph). A layer is switched through `_compiled_call_impl`, which
        `nn.Module.__call__` takes where set, so the decode step, outside the block, runs the layers as before."""
        if len(caches) != len(self._prefill_layers):
            raise ValueError(f"{len(caches)} caches for {len(self._prefill_layers)} decoder layers")
        held = []
        try:
            for layer, cache in zip(self._prefill_layers, caches, strict=True):
                numbered = [(m, m.layer_idx) for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
                held.append((layer, layer._compiled_call_impl, numbered))
                for module, _ in numbered:
                    module.layer_idx = 0
                layer._compiled_call_impl = functools.partial(self._run_layer, layer, cache)
            yield
        finally:
            for layer, before, numbered in reversed(held):  # last changed, first restored
                layer._compiled_call_impl = before
                for module, index in numbered:
                    module.layer_idx = index

    def _run_layer(self, layer: nn.Module, into: Any, /, *args: Any, **kwargs: Any) -> Any:
        """One decoder layer's prefill call through the shared compiled graph, into the cache `into`."""
        key = next((k for k in ("past_key_values", "cache") if kwargs.get(k) is not None), None)
        if key is None:
            raise RuntimeError(f"rollout.compile_prefill: {type(layer).__name__} was called without its KV cache "
                               "(as `past_key_values` or `cache`), so its compiled prefill has nowhere to put its "
                               "keys and values; set rollout.compile_prefill=false")
        assert self._prefill_layer is not None  # `_layers_compiled` switches layers in only where it exists
        return self._prefill_layer(layer, *args, **(kwargs | {key: into}))

    def _forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: Any,
                 shared: tuple[int, int] = (1, 0)) -> torch.Tensor:
        extra = {SHARED_PREFIX: shared} if shared[0] > 1 else {}
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=True, logits_to_keep=1, **extra)
        return out.logits[:, -1, :]

    @property
    def decode_kernels(self) -> dict[str, bool] | None:
        """With the Triton attention, its switches as this loop runs them (`zbench.engine.decode_attention`: `DENSE`,
        `ONE_GRID`; `pdl`: `PDL` in effect for its kernels on this device; `inductor_pdl`: Inductor's kernels of the
        recorded step compiled for it too, which the chain needs); None with SDPA."""
        if self.attention != "triton":
            return None
        from zbench.engine import decode_attention

        return {"dense": decode_attention.DENSE, "one_grid": decode_attention.ONE_GRID,
                "pdl": decode_attention.pdl_applies(self.device), "inductor_pdl": self.pdl}

    def steps_a_graph(self, top_p: float) -> int:
        """The decode steps one replay runs in `generate` at this top_p: `steps_per_graph` where the steps draw in
        the graph, else 1."""
        return self.steps_per_graph if self.draws_in_graph(top_p) else 1

    def draws_in_graph(self, top_p: float) -> bool:
        """Whether `generate` at this top_p draws inside the recorded step (`_step`) rather than between steps."""
        return self.sample_in_graph and top_p >= 1.0

    def _step(self, mask: torch.Tensor, cache: Any, state: LoopState, temperature: float, pad_id: int,
              shared: tuple[int, int]) -> None:
        """One decode step with its draw and bookkeeping, for one recorded graph: attend the token fed (its mask
        column), run the model, draw the next token at the step counter (`race`), pad it where the row is done,
        write it to the responses, and feed it to the next step. Everything it changes lives in `state`, `mask`
        and `cache`, at fixed addresses, so the host only replays the graph and reads `state.done` now and then."""
        from zbench.engine.race_sampling import race

        mask.index_fill_(1, state.column, 1)
        logits = self._forward(state.token, state.position, mask, cache, shared)
        state.step.add_(1)
        drawn = torch.where(state.done, pad_id, race(logits, state.seed, state.step, temperature))
        state.responses.index_copy_(1, state.step, drawn[:, None])
        state.done.logical_or_((drawn[:, None] == state.eos).any(dim=1))
        state.token.copy_(drawn[:, None])
        state.position.add_(1)
        state.column.add_(1)

    def release(self) -> None:
        """Drop the KV cache (before the replica is parked off the accelerator)."""
        if self._cache_memory is not None:  # its pages now; its addresses once nothing views them
            self._cache_memory.release()
        self._cache_slot = self._cache_memory = None
        self._chains.clear()  # they replay over the cache and loop state just dropped
        self._chain_pool = None  # a new pool for the next ones: this one goes once nothing lives in it

    def free_cache(self) -> None:
        """Give the KV cache's GPU memory back until the next `generate`: its pages where it lives at fixed addresses
        (kept for the recorded graphs, mapped again by `generate`), else the whole cache."""
        if self._cache_memory is not None:
            self._cache_memory.release()
        else:
            self.release()

    def _static_cache(self, batch: int, length: int, device: torch.device) -> Any:
        """transformers' static cache for (batch, length); where the cache is released between rollouts and the
        device can do so at fixed addresses, its layers' keys and values are placed in one `ReleasableMemory`
        (`self._cache_memory`) instead of allocated by each layer at its first write."""
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=length)
        if not self.cache_at_fixed_addresses:
            return cache
        layers = cache.layers
        config = self.model.config.get_text_config(decoder=True)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        dtype = next(self.model.parameters()).dtype
        per_tensor = batch * heads * length * head_dim
        memory = device_memory.ReleasableMemory(2 * len(layers) * per_tensor * dtype.itemsize, device)
        flat = memory.tensor.view(dtype)
        for i, layer in enumerate(layers):  # as StaticLayer.lazy_initialization sets a layer up
            layer.device, layer.batch_size, layer.num_heads = device, batch, heads
            layer.k_head_dim = layer.v_head_dim = head_dim
            layer.keys, layer.values = (flat[(2 * i + j) * per_tensor: (2 * i + j + 1) * per_tensor]
                                        .view(batch, heads, length, head_dim) for j in (0, 1))
            layer.cumulative_length = layer.cumulative_length.to(device)
            for tensor in (layer.keys, layer.values, layer.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
            layer.is_initialized = True
        self._cache_memory = memory
        return cache

    def _cache(self, batch: int, length: int, new_tokens: int, eos_ids: list[int],
               device: torch.device) -> tuple[Any, torch.Tensor, LoopState]:
        key = (batch, length, new_tokens, *eos_ids)
        self.wake_seconds = 0.0
        if self._cache_slot is None or self._cache_slot[0] != key:
            # one cache at a time: a new prompt-width bucket replaces the last one (freed before allocating)
            self.release()
            if self.cache_at_fixed_addresses:  # as below: one phase's memory at a time
                torch.cuda.empty_cache()
            mask = torch.zeros(batch, length, dtype=torch.long, device=device)
            state = LoopState.allocate(batch, new_tokens, eos_ids, device)
            if self.compile:  # changed in place by the recorded step
                for tensor in (mask, *state.tensors()):
                    torch._dynamo.mark_static_address(tensor)
            self._cache_slot = (key, self._static_cache(batch, length, device), mask, state)
        elif self._cache_memory is not None and not self._cache_memory.held:
            # training's cached blocks go back first, so the device holds one phase's memory at a time
            start = time.perf_counter()
            torch.cuda.empty_cache()
            self._cache_memory.restore()
            self.wake_seconds = time.perf_counter() - start
        _, cache, mask, state = self._cache_slot
        cache.reset()  # also what the pages mapped again held
        mask.zero_()
        return cache, mask, state

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 mask: torch.Tensor, samples: int = 1) -> tuple[torch.Tensor, tuple[int, int]]:
        """Run the prompts through the model into `cache` (positions 0..width-1); returns each row's next-token
        logits (B, V), and the runs of rows whose prompt columns the decode step may read once for all of them:
        (`samples`, width) where every run of `samples` consecutive rows holds one prompt and it was computed once
        for them, else (1, 0).

        Each distinct prompt runs once, and only from the first column some row attends: GRPO's `n` samples of a
        prompt arrive as `n` equal rows, and the replica pads every batch to one wide prompt width for its recorded
        step (`one_prompt_width`), which the eager prefill would otherwise compute (at 128 rows, 32 prompts x 4,
        padded to 512: 0.39 s of a rollout's 2.38 s of kernels on an H200, results/reference/h200-prefill-20261127).
        The distinct prompts' keys and values go through a scratch cache (about 0.9 GB at 32 prompts of the
        Qwen3-0.6B shape, while it lasts) into their rows' slots of the static cache, at the columns they hold there.
        Where a layer's static cache is anything but transformers' plain `StaticLayer` (a sliding window keeps only
        the window; indexer keys, recurrent states), or a transformers too old to place a write by
        `cumulative_length`, every row prefills at the full width, and shares nothing."""
        from transformers.cache_utils import DynamicCache, StaticLayer

        width = input_ids.shape[1]
        layers = getattr(cache, "layers", [])
        if not layers or not all(type(layer) is StaticLayer and hasattr(layer, "cumulative_length") for layer in layers):
            return self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                              past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :], (1, 0)
        attended = attention_mask.bool().any(0)
        lead = int(attended.int().argmax()) if bool(attended.any()) else 0  # columns before it: padding in every row
        rows = torch.cat([input_ids[:, lead:], attention_mask[:, lead:].to(input_ids.dtype)], dim=1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        ids, kept = distinct[:, : width - lead], distinct[:, width - lead:]
        scratch = DynamicCache(config=self.model.config)
        # each compiled layer's own cache, else the model's scratch cache holds every layer's
        caches = [DynamicCache() for _ in self._prefill_layers]
        with self._layers_compiled(caches):
            logits = self.model(input_ids=ids, attention_mask=kept, position_ids=(kept.cumsum(-1) - 1).clamp(min=0),
                                past_key_values=scratch, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        written = [cache.layers[0] for cache in caches] or scratch.layers
        for layer, held in zip(layers, written, strict=True):
            layer.cumulative_length.fill_(lead)  # StaticLayer.update writes from here on, and counts on
            layer.update(held.keys[inverse], held.values[inverse])
        batch = input_ids.shape[0]
        # one prompt a run of `samples` rows: then their prompt columns hold one computation's keys and values
        runs = samples > 1 and batch % samples == 0
        if runs:
            per_run = inverse.view(-1, samples)
            runs = bool((per_run == per_run[:, :1]).all())
        return logits[inverse], ((samples, width) if runs else (1, 0))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float, top_p: float, pad_id: int, eos_ids: list[int],
                 generator: torch.Generator | None, samples: int = 1) -> torch.Tensor:
        """Left-padded prompts (B, P) on the model's device -> (B, max_new_tokens) responses, `pad_id` after EOS.
        `samples` > 1: the rows come as runs of that many samples of one prompt (GRPO's n), whose prompt part of the
        cache the Triton attention then reads once a run (checked against the prompts: rows that differ share
        nothing)."""
        batch, width = input_ids.shape
        device = input_ids.device
        with part("gen/cache"):  # the parts of a step profile's gen phase (zbench.engine.profiling)
            cache, mask, state = self._cache(batch, width + max_new_tokens, max_new_tokens, eos_ids, device)
            mask[:, :width] = attention_mask
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        with part("gen/prefill"):
            logits, shared = self._prefill(input_ids, attention_mask, positions, cache, mask, samples)
        if self.attention != "triton":  # SDPA reads every row's cache anyway
            shared = (1, 0)
        self.shared_prefix = shared
        with part("gen/decode"):
            return self._decode_loop(logits, positions, width, mask, cache, state, max_new_tokens=max_new_tokens,
                                     temperature=temperature, top_p=top_p, pad_id=pad_id, eos_ids=eos_ids,
                                     generator=generator, shared=shared)

    def _decode_loop(self, logits: torch.Tensor, positions: torch.Tensor, width: int, mask: torch.Tensor, cache: Any,
                     state: LoopState, *, max_new_tokens: int, temperature: float, top_p: float, pad_id: int,
                     eos_ids: list[int], generator: torch.Generator | None, shared: tuple[int, int]) -> torch.Tensor:
        """`generate`'s tokens after the prefill: drawn inside the recorded step where it can, else between steps."""
        if self.draws_in_graph(top_p):
            return self._generate_in_graph(logits, positions, width, mask, cache, state, temperature=temperature,
                                           pad_id=pad_id, seed=self._seed(generator), shared=shared)
        batch, device = logits.shape[0], logits.device
        eos = torch.tensor(eos_ids, device=device)
        out = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        pos = positions[:, -1:] + 1
        for t in range(max_new_tokens):
            tok = sample_tokens(logits, temperature, top_p, generator)
            tok = torch.where(done, pad_id, tok)
            out[:, t] = tok
            done |= torch.isin(tok, eos)
            if t + 1 == max_new_tokens or ((t + 1) % self.sync_every == 0 and bool(done.all())):
                break
            mask[:, width + t] = 1
            if self.compile:  # the previous step's logits are consumed: let the graph replay over them
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._decode(tok[:, None], pos, mask, cache, shared)
            pos = pos + 1
        return out

    @staticmethod
    def _seed(generator: torch.Generator | None) -> int:
        """The in-graph draw's seed: the generator's (the seed it was made with, however far it has drawn since), or
        one from torch's global generator where none is given, as the eager draw would use it."""
        seed = generator.initial_seed() if generator is not None else int(torch.randint(2**62, ()))
        return seed % 2**63

    def _generate_in_graph(self, logits: torch.Tensor, positions: torch.Tensor, width: int, mask: torch.Tensor,
                           cache: Any, state: LoopState, *, temperature: float, pad_id: int,
                           seed: int, shared: tuple[int, int]) -> torch.Tensor:
        """`generate`'s loop with each step's draw and bookkeeping inside the recorded step (`_step`): the host
        replays one graph a token and syncs only to check for all rows done, every `sync_every` tokens. The draws
        are the race of `race_sampling` at (seed, step, row, token), so a seed repeats its rollout."""
        from zbench.engine.race_sampling import race

        state.seed.fill_(seed)
        state.step.zero_()
        first = race(logits, state.seed, state.step, temperature)
        state.responses.fill_(pad_id)
        state.responses[:, 0] = first
        state.done.copy_((first[:, None] == state.eos).any(dim=1))
        state.token.copy_(first[:, None])
        state.position.copy_(positions[:, -1:] + 1)
        state.column.fill_(width)
        if self.compile and self.steps_per_graph > 1:
            self._replay_chained(mask, cache, state, (temperature, pad_id, shared))
            return state.responses.clone()
        for t in range(1, state.responses.shape[1]):
            if t % self.sync_every == 0 and bool(state.done.all()):
                break
            if self.compile:
                torch.compiler.cudagraph_mark_step_begin()
            self._decode_and_draw(mask, cache, state, temperature, pad_id, shared)
        return state.responses.clone()

    def _replay_chained(self, mask: torch.Tensor, cache: Any, state: LoopState,
                        constants: tuple[float, int, tuple[int, int]]) -> None:
        """`_generate_in_graph`'s steps with `steps_per_graph` of them in one CUDA graph (`chained_schedule`): the
        first step runs the compiled step as it is (compiling it the first time), then each run of steps replays a
        graph captured from the compiled step for that many steps, over the same cache, mask and loop state, so it
        draws the same tokens as one step a replay, and checks for all rows done before the same steps."""
        schedule = chained_schedule(state.responses.shape[1], self.sync_every, self.steps_per_graph)
        for start, check, lengths in schedule:
            if check and bool(state.done.all()):
                return
            if start == 1:  # on the stream the graphs are captured on, so its cuBLAS workspace stays off their pool
                self._chain_stream = self._chain_stream or torch.cuda.Stream(mask.device)
                self._chain_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._chain_stream):
                    self._decode_and_draw(mask, cache, state, *constants)
                torch.cuda.current_stream().wait_stream(self._chain_stream)
                continue
            for length in lengths:
                key = (self._cache_slot[0], *constants, length)  # the slot `generate` took
                if key not in self._chains:
                    self._chain_pool = self._chain_pool or torch.cuda.graph_pool_handle()
                    graph = torch.cuda.CUDAGraph()
                    # recorded, not run; other threads of the process (a trainer's) may use the GPU meanwhile. The
                    # step compiled at the first step: a guard that failed now would record a recompile, so it raises
                    with (torch.cuda.graph(graph, pool=self._chain_pool, stream=self._chain_stream,
                                           capture_error_mode="thread_local"),
                          torch.compiler.set_stance("fail_on_recompile")):
                        for _ in range(length):
                            self._decode_and_draw(mask, cache, state, *constants)
                    self._chains[key] = graph
                self._chains[key].replay()


class HFRollout:
    """Sampling with transformers models: `generate` (dynamic or static KV cache) or `GraphDecoder` (static
    cache, decode step as a CUDA graph); left-padded prompts, temperature/top-p, EOS."""

    backend = "hf"

    def __init__(self, model: nn.Module, *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                 temperature: float, top_p: float, static_cache: bool, device: torch.device,
                 cuda_graph: bool = False, parked: bool = False, decode_attention: str = "auto",
                 prompt_width: int | None = None, samples: int = 1, release_kv_cache: bool = False,
                 steps_per_graph: int = 1, compile_prefill: bool = True):
        self.model = model.eval()
        self.samples = samples  # rows come as runs of this many samples of one prompt (GRPO's n)
        self.pad_id, self.eos_ids = pad_id, eos_ids
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.static_cache = static_cache
        self.device = device
        for p in self.model.parameters():
            p.requires_grad_(False)
        # a replica parked on the CPU between rollouts comes back at new addresses every step, which would make
        # the CUDA graph re-record each time: it runs the same loop eagerly instead
        compile_step = device.type == "cuda" and not parked
        # the graph loop's attention as it runs (None without the graph loop), for the case's result.json
        dtype = next(self.model.parameters()).dtype
        self.decode_attention = (resolve_decode_attention(decode_attention, device, self.model.config, dtype)
                                 if cuda_graph else None)
        self.graph = (GraphDecoder(self.model, compile=compile_step, attention=self.decode_attention,
                                   release_cache=release_kv_cache, steps_per_graph=steps_per_graph,
                                   compile_prefill=compile_step and compile_prefill)
                      if self.decode_attention else None)
        # the graph loop's projection groups merged into one matrix multiply each (None without the graph loop)
        self.merged_projections = self.graph.merged_projections if self.graph is not None else None
        # the one width every batch is padded to (None: widths as they come)
        self.prompt_width = one_prompt_width(prompt_width, compile_step, self.decode_attention)
        self.seconds: dict[str, float] = {}  # of the last rollout: sampling, device to host included
        # the GPU's memory in use at the end of the last rollout, before the graph loop freed its KV cache (0: not
        # freed, the caller's own sample after the rollout sees it all), in GiB
        self.awake_used_gb = 0.0

    @property
    def engine(self) -> str:
        """Which loop samples, for the summary's rollout_engine (`zbench.config.rollout_engine` predicts it from a
        config): `hf-graph` (the decode step replayed as a CUDA graph), `hf-loop` (the same loop run eagerly: a
        parked replica, a CPU), `hf-static` (transformers' static cache) or `hf-generate`."""
        if self.graph is not None:
            return "hf-graph" if self.graph.compile else "hf-loop"
        return "hf-static" if self.static_cache else "hf-generate"

    @property
    def graph_sampling(self) -> str | None:
        """Where the graph loop draws its tokens, for the case's result.json: `in-graph` (inside the recorded step,
        `zbench.engine.race_sampling`: a compiled loop with top_p 1) or `eager` (between steps, as
        `sample_tokens`); None without the graph loop."""
        if self.graph is None:
            return None
        return "in-graph" if self.graph.draws_in_graph(self.top_p) else "eager"

    @property
    def decode_kernels(self) -> dict[str, bool] | None:
        """The Triton decode attention's switches as the graph loop runs them, for the case's result.json
        (`GraphDecoder.decode_kernels`); None without the graph loop or with SDPA."""
        return self.graph.decode_kernels if self.graph is not None else None

    @property
    def steps_per_graph(self) -> int | None:
        """The graph loop's decode steps a replay, as it runs them at this rollout's top_p, for the case's result.json
        (`GraphDecoder.steps_a_graph`); None without the graph loop."""
        return self.graph.steps_a_graph(self.top_p) if self.graph is not None else None

    @property
    def prefill(self) -> str | None:
        """How the graph loop prefills, for the case's result.json: `compiled` or `eager`; None without the graph
        loop."""
        if self.graph is None:
            return None
        return "compiled" if self.graph.prefill_compiled else "eager"

    @property
    def kv_cache(self) -> str | None:
        """What the graph loop does with its KV cache between rollouts, for the case's result.json: `held` (kept
        allocated through training), `unmapped` (its GPU pages given back and mapped again at the same addresses:
        `zbench.engine.device_memory`) or `dropped` (freed and allocated again); None without the graph loop."""
        if self.graph is None:
            return None
        if not self.graph.release_cache:
            return "held"
        return "unmapped" if self.graph.cache_at_fixed_addresses else "dropped"

    @property
    def shared_rows(self) -> int | None:
        """How many rows read their prompt's keys and values once for all of them in the last rollout's decode steps
        (`GraphDecoder.generate`'s `samples`, where the prompts and the attention allow it), 1 where each row read
        its own; None without the graph loop."""
        return self.graph.shared_prefix[0] if self.graph is not None else None

    def to(self, device: torch.device | str) -> None:
        """Move the replica (used to free accelerator memory while training under offload)."""
        if self.graph is not None and torch.device(device).type == "cpu":
            self.graph.release()
        self.model.to(device)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """Sample one response per row; returns responses padded to `max_new_tokens` and their mask."""
        start = time.perf_counter()
        releasing = self.graph if self.graph is not None and self.graph.release_cache else None
        try:
            out = self._generate(input_ids, attention_mask, seed)
        except BaseException:
            if releasing is not None:  # whatever ends the rollout, training gets the cache's memory back
                with contextlib.suppress(Exception):  # the rollout's own error is the one to report
                    releasing.free_cache()
            raise
        self.seconds = {"engine": time.perf_counter() - start}
        if releasing is not None:
            if releasing.cache_at_fixed_addresses:  # inside the engine's time; 0 at the first rollout
                self.seconds["wake"] = releasing.wake_seconds
            if self.device.type == "cuda":
                with part("gen/memory"):
                    self.awake_used_gb = gpu_memory_in_use_gb(self.device)
            start = time.perf_counter()
            with part("gen/sleep"):
                releasing.free_cache()
            self.seconds["sleep"] = time.perf_counter() - start
        return out

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        from transformers import GenerationConfig

        if self.graph is not None:
            if self.prompt_width and input_ids.shape[1] < self.prompt_width:  # more left padding changes nothing
                extra = self.prompt_width - input_ids.shape[1]
                input_ids = F.pad(input_ids, (extra, 0), value=self.pad_id)
                attention_mask = F.pad(attention_mask, (extra, 0))
            generator = torch.Generator(self.device).manual_seed(seed)
            responses = self.graph.generate(
                input_ids.to(self.device), attention_mask.to(self.device), max_new_tokens=self.max_new_tokens,
                temperature=self.temperature, top_p=self.top_p, pad_id=self.pad_id, eos_ids=self.eos_ids,
                generator=generator, samples=self.samples)
            with part("gen/to_host"):  # waits for the decode's last kernels, which its part only launched
                responses = responses.cpu()
            return {"responses": responses, "response_mask": response_mask_from(responses, self.eos_ids,
                                                                                self.pad_id)}
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        sample = self.temperature > 0
        gen = GenerationConfig(
            do_sample=sample,
            temperature=self.temperature if sample else None,
            top_p=self.top_p if sample else None,
            top_k=0 if sample else None,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            use_cache=True,
            cache_implementation="static" if self.static_cache else None,
        )
        ids = input_ids.to(self.device)
        mask = attention_mask.to(self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        responses = out[:, ids.shape[1]:]
        width = responses.shape[1]
        if width < self.max_new_tokens:
            pad = responses.new_full((responses.shape[0], self.max_new_tokens - width), self.pad_id)
            responses = torch.cat([responses, pad], dim=1)
        responses = responses.cpu()
        resp_mask = response_mask_from(responses, self.eos_ids, self.pad_id)
        return {"responses": responses, "response_mask": resp_mask}

    @torch.no_grad()
    def load_weights(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the replica's parameters by name (merged projections' rows included); returns the
        bytes copied."""
        from zbench.engine.merged_projections import named_weights

        params = named_weights(self.model)
        copied = 0
        for name, tensor in named:
            target = params[name]
            target.copy_(tensor.to(target.device, target.dtype), non_blocking=True)
            copied += target.numel() * target.element_size()
        return copied


def size_buckets(named: list[tuple[str, Any]], limit_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive groups of parameters whose full (ZeRO-3: `ds_numel`) size reaches `limit_bytes` at most once
    each: a group closes as soon as it holds `limit_bytes` or more; a single larger tensor is a group alone."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, param in named:
        bucket.append((name, param))
        size += getattr(param, "ds_numel", param.numel()) * param.element_size()
        if size >= limit_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def trained_weights(module: nn.Module, zero_stage: int, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter of a DeepSpeed-wrapped module.

    ZeRO-3 parameters are partitioned: gather a bucket of them at a time (all ranks take part in every gather),
    yield their full values, and release them before the next bucket.
    """
    named = list(module.named_parameters())
    if zero_stage < 3:
        yield from ((n, p.detach()) for n, p in named)
        return
    import deepspeed

    for bucket in size_buckets(named, bucket_mb * 2**20):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            yield from ((n, p.detach()) for n, p in bucket)
