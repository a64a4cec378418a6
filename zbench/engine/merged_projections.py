"""Sibling projections of one input as one matrix multiply, for the rollout replica's decode loop.

Hugging Face's decoders run q, k and v (and the MLP's gate and up) as separate `nn.Linear`s over the same hidden
states. At decode time a projection multiplies a few dozen rows by a weight of a few MB: each is a small, latency-
bound kernel, and the decode step of Qwen3-0.6B spends most of its non-attention time in them (five of its seven
projections a layer; results/reference/h200x2-decode-attention-20261127). vLLM merges them; `merge_projections`
does the same to a transformers model in place, without touching its forward code:

- The siblings' weights (and biases) become one `MergedProjection` on their parent, e.g. `self_attn.merged_q_k_v`,
  rows in the siblings' order. Each sibling becomes a `ProjectionSlice`: its `weight` and `bias` are views of its
  rows, so it keeps its name for weight loading (`named_weights`) and its parameters exist once.
- The first sibling (q, gate) computes the whole merged product and leaves it on the group; a later sibling called
  with the very same input tensor takes its columns of it, and the last one clears it. A sibling called with any
  other input multiplies by its own rows, so the result never depends on the call order; it is only faster in the
  order decoders use. Under `torch.compile` the hand-over is traced away: one matrix multiply, sliced. The hand-over
  is keyed on the input tensor's identity: an input changed in place between siblings would be answered from the
  product before the change (no decoder does that). A module that calls its first sibling without the others on
  the same input next (k and v first, or not at all) leaves the product held on the group until its next call
  (under `torch.compile` a graph output, and a recompilation when the group's state changes): correct, but
  slower and larger than unmerged. The Llama, Qwen and Mistral families call q, k, v and gate, up in order.

The product is the same as the separate ones' up to the matrix-multiply kernel's summation order. On an H200 the
graph loop's rollout of 512 tokens took 1.16 s instead of 1.33 s at 32 rows and 2.33 s instead of 2.52 s at 128
(results/reference/h200x2-merged-projections-20261127).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PREFIX = "merged_"


class MergedProjection(nn.Module):
    """The merged weight (and bias) of sibling projections, and the product its first sibling hands to the rest."""

    def __init__(self, parts: list[nn.Linear]):
        super().__init__()
        biased = parts[0].bias is not None
        self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        self.bias = (nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)  # type: ignore[misc]
                     if biased else None)
        edges = list(itertools.accumulate((p.out_features for p in parts), initial=0))
        self.bounds = list(itertools.pairwise(edges))
        self.handed: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, merged product) awaiting siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ProjectionSlice(nn.Module):
    """One sibling of a `MergedProjection`: `nn.Linear`'s call, answered from the merged product when it can be."""

    def __init__(self, merged: MergedProjection, index: int, in_features: int):
        super().__init__()
        object.__setattr__(self, "merged", merged)  # not a submodule: the parent owns it, once
        self.index, self.last = index, index == len(merged.bounds) - 1
        self.start, self.stop = merged.bounds[index]
        self.in_features, self.out_features = in_features, self.stop - self.start

    @property
    def weight(self) -> torch.Tensor:
        return self.merged.weight[self.start:self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.merged.bias
        return None if bias is None else bias[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.merged
        handed = merged.handed
        if handed is not None and handed[0] is x:
            product = handed[1]
            if self.last:
                merged.handed = None
        elif self.index == 0:
            product = merged(x)
            merged.handed = (x, product)
        else:  # another input than the first sibling's: its own rows only, and nothing is held for later
            merged.handed = None
            return F.linear(x, self.weight, self.bias)
        return product[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.start}:{self.stop}"


def _mergeable(parts: list[Any]) -> bool:
    """Plain `nn.Linear`s (not quantised or otherwise subclassed) over one input size, one dtype and device, all
    with a bias or none."""
    if not all(type(p) is nn.Linear for p in parts):
        return False
    first = parts[0]
    tensors = [t for p in parts for t in (p.weight, p.bias) if t is not None]
    return (all(p.in_features == first.in_features and (p.bias is None) == (first.bias is None) for p in parts)
            and all(t.dtype == first.weight.dtype and t.device == first.weight.device for t in tensors))


@torch.no_grad()
def merge_projections(model: nn.Module) -> int:
    """Merge every module's q/k/v and gate/up `nn.Linear`s (see the module's docstring), in place, for inference
    (the merged parameters take no gradient). Returns how many merged groups the model now has (a second call
    changes nothing); modules whose siblings differ in input size, dtype, device or bias, or are not plain
    `nn.Linear`s, are left as they are. The model's `state_dict()` then holds the merged tensors (`merged_q_k_v`);
    `named_weights` gives the transformers names."""
    for module in list(model.modules()):
        for names in SIBLINGS:
            parts = [getattr(module, n, None) for n in names]
            if not _mergeable(parts):
                continue
            group = MergedProjection(parts)
            module.add_module(PREFIX + "_".join(n.removesuffix("_proj") for n in names), group)
            for i, (name, part) in enumerate(zip(names, parts, strict=True)):
                setattr(module, name, ProjectionSlice(group, i, part.in_features))
    return sum(isinstance(m, MergedProjection) for m in model.modules())


def named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of `model` under its transformers name: `named_parameters()`, with a merged projection's
    siblings as views of their rows (`q_proj.weight`, ...) in place of the merged tensor. Copying into a view
    writes the merged tensor."""
    out: dict[str, torch.Tensor] = {}
    merged: set[int] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, MergedProjection):
            merged.update(id(p) for p in module.parameters())
        elif isinstance(module, ProjectionSlice):
            out[f"{prefix}.weight"] = module.weight
            if module.bias is not None:
                out[f"{prefix}.bias"] = module.bias
    out.update((name, p) for name, p in model.named_parameters() if id(p) not in merged)
    return out
