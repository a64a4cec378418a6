"""`model.activation_memory_budget`: compiled decoder layers keep a share of their activations and recompute the
rest inside their own backward. On the CPU the layers compile through Dynamo and AOTAutograd with the min-cut
partitioner Inductor uses (`aot_eager_decomp_partition`: the same partitioning, eager kernels), through the
worker's real model build and a real DeepSpeed engine: a lower budget keeps fewer bytes for the backward and makes
the same update, and a later model in the same process compiles for its own budget (Dynamo would otherwise reuse
the graphs of the first)."""

from __future__ import annotations

import tempfile

import torch
from test_old_log_prob import _batch, _cfg, assert_same_update

from zbench.config import from_dict
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


class _PartitionedOnCpu(PolicyWorker):
    """A worker whose decoder layers compile on the CPU as a CUDA case's do, partitioned by the min-cut partitioner
    (which the activation budget steers), with eager kernels."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.compile_backend = "aot_eager_decomp_partition"

    def _compiles_layers(self) -> bool:
        return True


def _saved_update(budget: float, port: int | None, stage: int = 2) -> tuple[PolicyWorker, dict, int]:
    """A ZeRO-`stage` worker (compiled layers, no checkpointing, `budget`), one GRPO update of the reference batch,
    and the bytes autograd saved for its backward over the update."""
    cfg = from_dict(_cfg(zero={"stage": stage}, model={"activation_memory_budget": budget}))
    worker = _PartitionedOnCpu(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-budget-"), str(resolve_model("tiny")))
    if port is not None:
        worker.join("127.0.0.1", port)
    worker.setup()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(t, torch.nn.Parameter):
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = worker.update_actor(_batch(pad_id=0))
    return worker, stats, saved


def test_a_lower_budget_keeps_less_and_makes_the_same_update():
    torch._dynamo.reset()
    full_worker, full, full_bytes = _saved_update(1.0, free_port())
    _, half, half_bytes = _saved_update(0.5, None)
    lean_worker, lean, lean_bytes = _saved_update(0.0, None)
    _, again, again_bytes = _saved_update(1.0, None)
    assert full_worker.compiled_layers == lean_worker.compiled_layers == len(full_worker.engine.module.model.layers)
    # each model compiled for its own budget, not for the one before it
    assert lean_bytes < half_bytes < full_bytes and lean_bytes < 0.8 * full_bytes, (lean_bytes, half_bytes, full_bytes)
    assert again_bytes == full_bytes
    assert_same_update(full, half)
    assert_same_update(full, again)
    assert_same_update(full, lean, (full_worker.engine.module.named_parameters(), lean_worker.engine.module.parameters()),
                       atol=1e-6)


def test_zero3_leaf_layers_take_the_budget_too():
    """At ZeRO-3 the layers compile as leaf modules (their `forward` compiled, DeepSpeed's gathers outside): the
    budget reaches that compile as well, with the same update."""
    from test_lm_head import _full_params

    torch._dynamo.reset()
    full_worker, full, full_bytes = _saved_update(1.0, free_port(), stage=3)
    lean_worker, lean, lean_bytes = _saved_update(0.0, None, stage=3)
    assert lean_worker.compiled_layers == len(lean_worker.engine.module.model.layers) > 0
    assert lean_bytes < 0.8 * full_bytes, (lean_bytes, full_bytes)
    assert_same_update(full, lean)
    before, after = dict(_full_params(full_worker)), dict(_full_params(lean_worker))
    for name, p in before.items():
        assert torch.allclose(p, after[name], atol=1e-6), name
