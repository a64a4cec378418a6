"""Rollout: sampling responses from a generation replica of the actor, and syncing trained weights into it.

The `hf` backend keeps a plain transformers copy of the actor on each rank. After every update the trained
weights are copied in (`sync_weights`): under ZeRO-0..2 every rank holds full parameters; under ZeRO-3 they are
gathered bucket by bucket so that no more than `bucket_mb` of extra memory is ever materialised.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def response_mask_from(responses: torch.Tensor, eos_ids: list[int], pad_id: int) -> torch.Tensor:
    """1 for response tokens up to and including the first EOS, 0 after it (and for padding)."""
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= responses == eos
    # tokens strictly after the first EOS are padding
    after_eos = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0
    return (~after_eos).long()


class HFRollout:
    """Sampling with `transformers` generate: KV cache, left-padded prompts, temperature/top-p, EOS."""

    backend = "hf"

    def __init__(self, model: nn.Module, *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                 temperature: float, top_p: float, static_cache: bool, device: torch.device):
        self.model = model.eval()
        self.pad_id, self.eos_ids = pad_id, eos_ids
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.static_cache = static_cache
        self.device = device
        for p in self.model.parameters():
            p.requires_grad_(False)

    def to(self, device: torch.device | str) -> None:
        """Move the replica (used to free accelerator memory while training under offload)."""
        self.model.to(device)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """Sample one response per row; returns responses padded to `max_new_tokens` and their mask."""
        from transformers import GenerationConfig

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
        """Copy tensors into the replica's parameters by name; returns the bytes copied."""
        params = dict(self.model.named_parameters())
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
