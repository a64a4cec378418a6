"""Merged sibling projections (`zbench.engine.merged_projections`): q/k/v and gate/up of real transformers models
as one matrix multiply each, with the same logits as the unmerged model, eagerly and under `torch.compile`; every
weight still under its transformers name, stored once, loadable through the rollout replica and kept tied when the
model moves; siblings that cannot be merged are left alone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from zbench.engine.merged_projections import (
    MergedProjection,
    ProjectionSlice,
    merge_projections,
    named_weights,
)
from zbench.engine.rollout import HFRollout

LAYERS = 2
MODEL_TYPES = ("qwen3", "qwen2", "llama")  # qwen2: q/k/v with biases


def _jitter(model: nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add seeded noise to every parameter: biases (zero at init) and norms become nonzero / non-trivial, so a
    wrong row, a dropped bias or a stale weight shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _tiny(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A two-layer grouped-query model of `model_type`, float32, seeded."""
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _jitter(model, seed + 1)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of widths 7, 4 and 6 (pad id 0) and their attention mask."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 512, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits of the attended (non-pad) positions."""
    return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


def _linear_calls(gm: torch.fx.GraphModule) -> int:
    return sum(node.op == "call_function" and node.target is torch._C._nn.linear for node in gm.graph.nodes)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_merged_model_has_the_same_logits_names_and_storage(model_type: str) -> None:
    """Two groups a layer merge; the logits over a left-padded batch are the unmerged model's; `named_weights` holds
    exactly the original names and values (biases included), as views of the merged tensors, which are the only
    storage: the model's parameter count is unchanged and the slices own no parameters."""
    model = _tiny(model_type)
    reference = copy.deepcopy(model)
    original = {name: p.detach().clone() for name, p in reference.named_parameters()}
    ids, mask = _batch()
    assert merge_projections(model) == 2 * LAYERS
    assert torch.allclose(_logits(model, ids, mask), _logits(reference, ids, mask), atol=1e-6, rtol=1e-6)

    named = named_weights(model)
    assert named.keys() == original.keys()
    for name, tensor in named.items():
        assert torch.equal(tensor, original[name]), name
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.k_proj.bias" in named
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())

    groups = [m for m in model.modules() if isinstance(m, MergedProjection)]
    slices = [m for m in model.modules() if isinstance(m, ProjectionSlice)]
    assert len(groups) == 2 * LAYERS and len(slices) == 5 * LAYERS
    assert all(not list(s.parameters()) for s in slices)
    storages = {g.weight.untyped_storage().data_ptr() for g in groups}
    assert all(s.weight.untyped_storage().data_ptr() in storages for s in slices)
    assert all(g.handed is None for g in groups)  # nothing held after the forward
    assert merge_projections(model) == 2 * LAYERS  # a second call merges nothing more and counts what is there
    assert len([m for m in model.modules() if isinstance(m, MergedProjection)]) == 2 * LAYERS


def test_compiled_merged_model_runs_four_matrix_multiplies_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced by dynamo (fullgraph), the hand-over disappears: each layer's graph holds 4 linear calls (q/k/v,
    o, gate/up, down) against the unmerged model's 7, plus the lm_head; the compiled logits equal eager ones and
    no product is left on the groups."""
    # DeepSpeed's ZeRO-3 Init swaps `F.linear` for its own, for the rest of the process ("this will persist"): an
    # earlier test in the same process leaves it there, and the graph would record that wrapper instead
    monkeypatch.setattr(F, "linear", torch._C._nn.linear)
    torch._dynamo.reset()
    merged = _tiny("qwen3")
    unmerged = copy.deepcopy(merged)
    assert merge_projections(merged) == 2 * LAYERS
    ids, mask = _batch()
    counts: dict[str, int] = {}
    for name, model in (("merged", merged), ("unmerged", unmerged)):
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor],
                    graphs: list[torch.fx.GraphModule] = graphs) -> Callable[..., Any]:
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
        with torch.no_grad():
            got = compiled(input_ids=ids, attention_mask=mask).logits
            # nothing left on the groups by the compiled call itself (the eager call below would clear it)
            assert all(m.handed is None for m in model.modules() if isinstance(m, MergedProjection))
            eager = model(input_ids=ids, attention_mask=mask).logits
        assert len(graphs) == 1
        counts[name] = _linear_calls(graphs[0])
        assert torch.allclose(got, eager, atol=1e-6, rtol=1e-6)
    assert counts == {"merged": 4 * LAYERS + 1, "unmerged": 7 * LAYERS + 1}
    torch._dynamo.reset()


@torch.no_grad()
def test_siblings_answer_their_own_rows_in_any_call_order() -> None:
    """On a merged (biased) attention module each sibling returns `F.linear` of its input with its original rows,
    whatever the order: k before q, k with another tensor than q's, q twice. In the decoder's order, with one input,
    k and v are views of q's product (the hand-over is taken); after the last sibling takes it, nothing is held."""
    model = _tiny("qwen2")
    attn = model.model.layers[0].self_attn
    names = ("q_proj", "k_proj", "v_proj")
    rows = {n: (getattr(attn, n).weight.detach().clone(), getattr(attn, n).bias.detach().clone()) for n in names}
    assert merge_projections(model) == 2 * LAYERS
    group = attn.merged_q_k_v
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)

    def call(name: str, inputs: torch.Tensor) -> torch.Tensor:
        out = getattr(attn, name)(inputs)
        expected = F.linear(inputs, *rows[name])
        assert out.shape == expected.shape and torch.allclose(out, expected, atol=1e-6, rtol=0), name
        return out

    q, k, v = call("q_proj", x), call("k_proj", x), call("v_proj", x)  # the decoder's order: one product
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert group.handed is None
    for name in ("k_proj", "q_proj", "v_proj"):  # k before q
        call(name, x)
    assert group.handed is None
    q, k = call("q_proj", x), call("k_proj", y)  # another tensor: k's own rows, not x's product
    assert k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    call("v_proj", y)
    for name in ("q_proj", "q_proj", "k_proj", "v_proj"):  # q twice
        call(name, x)
    assert group.handed is None


class _Projections(nn.Module):
    """Bare siblings on a parent, as a decoder's attention holds them."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q, k, v


def _float64_bias(linear: nn.Linear) -> nn.Linear:
    linear.bias = nn.Parameter(linear.bias.detach().double())
    return linear


class _QuantisedLinear(nn.Linear):
    """Stands for a subclass (quantised, LoRA, ...) whose forward is not `F.linear` of its weight."""


@pytest.mark.parametrize(("siblings", "merged"), [
    (lambda: (nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)), 1),  # the control: plain ones merge
    (lambda: (nn.Linear(8, 8), _QuantisedLinear(8, 4), nn.Linear(8, 4)), 0),
    (lambda: (nn.Linear(8, 8), nn.Linear(6, 4), nn.Linear(8, 4)), 0),  # another input size
    (lambda: (nn.Linear(8, 8), nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)), 0),  # a bias on q only
    (lambda: (nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4, dtype=torch.float64)), 0),
    (lambda: (nn.Linear(8, 8), nn.Linear(8, 4), _float64_bias(nn.Linear(8, 4))), 0),  # the bias alone differs
], ids=["plain", "subclass", "in_features", "some_bias", "dtype", "bias_dtype"])
def test_siblings_that_cannot_share_one_multiply_are_left_as_they_are(
        siblings: Callable[[], tuple[nn.Module, nn.Module, nn.Module]], merged: int) -> None:
    """A group merges only if its siblings are plain `nn.Linear`s of one input size, dtype and bias-ness; otherwise
    the count is 0 and the parent keeps the very same modules (nothing added)."""
    parts = siblings()
    parent = _Projections(*parts)
    assert merge_projections(parent) == merged
    if merged:
        assert isinstance(parent.q_proj, ProjectionSlice) and isinstance(parent.merged_q_k_v, MergedProjection)
    else:
        assert (parent.q_proj, parent.k_proj, parent.v_proj) == parts
        assert list(dict(parent.named_children())) == ["q_proj", "k_proj", "v_proj"]
        assert named_weights(parent).keys() == dict(parent.named_parameters()).keys()


def test_rollout_replica_loads_trained_weights_into_the_merged_rows() -> None:
    """`HFRollout(cuda_graph=True)` on CPU merges its replica (2 groups a layer); `load_weights` with the trained
    model's `named_parameters()` writes every tensor (merged rows and biases included) and counts its bytes: the
    replica's logits become the trained model's."""
    base = _tiny("qwen2")
    rollout = HFRollout(copy.deepcopy(base), pad_id=0, eos_ids=[1], max_new_tokens=4, temperature=0.0, top_p=1.0,
                        static_cache=False, device=torch.device("cpu"), cuda_graph=True)
    assert rollout.merged_projections == 2 * LAYERS
    trained = copy.deepcopy(base)
    _jitter(trained, seed=42, scale=0.05)
    ids, mask = _batch()
    before = _logits(rollout.model, ids, mask)
    assert torch.allclose(before, _logits(base, ids, mask), atol=1e-5, rtol=1e-5)
    copied = rollout.load_weights(trained.named_parameters())
    assert copied == sum(p.numel() * p.element_size() for p in trained.parameters())
    after, expected = _logits(rollout.model, ids, mask), _logits(trained, ids, mask)
    assert torch.allclose(after, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before, atol=1e-2)
    for name, tensor in named_weights(rollout.model).items():
        assert torch.equal(tensor, dict(trained.named_parameters())[name]), name


def test_moving_the_model_keeps_the_named_rows_views_of_the_merged_weight() -> None:
    """After `model.to(torch.float64)` a sibling's named weight is float64 and still a view of the merged weight:
    it shares its storage, and copying into it writes the merged tensor's rows (only those)."""
    model = _tiny("llama")
    reference = copy.deepcopy(model).to(torch.float64)
    merge_projections(model)
    model.to(torch.float64)
    ids, mask = _batch()
    assert torch.allclose(_logits(model, ids, mask), _logits(reference, ids, mask), atol=1e-12, rtol=1e-12)
    attn = model.model.layers[1].self_attn
    merged = attn.merged_q_k_v.weight
    assert merged.dtype == torch.float64
    weight = named_weights(model)["model.layers.1.self_attn.k_proj.weight"]
    assert weight.dtype == torch.float64
    assert weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    before = merged.detach().clone()
    with torch.no_grad():
        weight.copy_(torch.full_like(weight, 3.0))
    start, stop = attn.q_proj.out_features, attn.q_proj.out_features + attn.k_proj.out_features
    assert torch.equal(merged[start:stop], torch.full_like(weight, 3.0))
    assert torch.equal(merged[:start], before[:start]) and torch.equal(merged[stop:], before[stop:])
