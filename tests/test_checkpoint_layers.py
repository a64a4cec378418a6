"""`model.checkpoint_layers`: activation checkpointing on the first N decoder layers only. The layers past N keep
their activations, the update is the same (real DeepSpeed on CPU, the embedded tiny model), the memory estimate
sits between full and no checkpointing, and bad values are refused by name."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.analyze.activations import geometry_memory
from zbench.config import ConfigError, from_dict, with_overrides
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _update(model: dict) -> tuple[PolicyWorker, dict]:
    """A ZeRO-2 worker built with `model` settings (the same initial weights every time) and one GRPO update."""
    cfg = from_dict(_cfg(zero={"stage": 2}, model=model))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-ckpt-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    return worker, worker.update_actor(_batch(pad_id=0))


def test_partial_checkpointing_makes_the_same_update():
    full_worker, full = _update({"gradient_checkpointing": True})
    part_worker, part = _update({"gradient_checkpointing": True, "checkpoint_layers": 1})
    _, none = _update({"gradient_checkpointing": False})
    layers = part_worker.engine.module.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert all(layer.gradient_checkpointing for layer in full_worker.engine.module.model.layers)
    for other in (part, none):
        assert torch.allclose(other["old_log_probs"], full["old_log_probs"], atol=1e-6)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert other[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    assert full["actor/grad_norm"] > 0
    for (name, a), b in zip(full_worker.engine.module.named_parameters(), part_worker.engine.module.parameters(),
                            strict=True):
        assert torch.allclose(a, b, atol=1e-7), name


def test_bad_values_are_refused_by_name():
    with pytest.raises(ConfigError, match=re.escape("model.checkpoint_layers: 4 layers checkpointed needs "
                                                    "model.gradient_checkpointing=true")):
        from_dict({"model": {"checkpoint_layers": 4}})
    with pytest.raises(ConfigError, match=re.escape("model.checkpoint_layers: must be >= 0, got -1")):
        from_dict({"model": {"gradient_checkpointing": True, "checkpoint_layers": -1}})
    cfg = from_dict(_cfg(model={"gradient_checkpointing": True, "checkpoint_layers": 3}))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-ckpt-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    with pytest.raises(ConfigError, match=r"model\.checkpoint_layers: 3 is more than the 2 decoder layers of .*; "
                                          r"at most 2, or null"):
        worker.setup()


def test_memory_estimate_falls_between_full_and_none():
    base = from_dict({"model": {"path": "qwen3-0.6b"}, "trainer": {"device": "cuda"},
                      "actor": {"micro_batch_size_per_gpu": 4}})

    def training_gb(**model: object) -> float:
        over = {f"model.{k}": v for k, v in model.items()}
        return geometry_memory(with_overrides(base, over), True, 141 * 2**30).training / 2**30

    full, none = training_gb(gradient_checkpointing=True), training_gb(gradient_checkpointing=False)
    half = training_gb(gradient_checkpointing=True, checkpoint_layers=14)
    assert training_gb(gradient_checkpointing=True, checkpoint_layers=28) == full
    assert full < half < none
    # each layer that keeps its activations adds the same amount
    quarter = training_gb(gradient_checkpointing=True, checkpoint_layers=21)
    assert half - quarter == pytest.approx(quarter - full, rel=1e-6)
