"""`zero.coalesce_grad_reduction`: a mini-batch's micro-batches reduced in one pass after the last backward
(DeepSpeed's `engine.coalesce_grad_reduction`) make the same update as DeepSpeed's per-micro-batch reduction, at
ZeRO-1, 2 and 3, with the optimizer offloaded and over two epochs of two mini-batches (real DeepSpeed on CPU, the
embedded tiny model, one rank, two micro-batches a step); stage 0 is refused by name."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _update(zero: dict, actor: dict | None = None) -> tuple[PolicyWorker, dict, int]:
    """A worker with these `zero` (and `actor`) settings, the same initial weights every time, after one GRPO
    update; and how many times it entered DeepSpeed's coalescing block."""
    cfg = from_dict(_cfg(zero=zero, actor=actor or {}))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-coalesce-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    assert worker.engine.gradient_accumulation_steps() == 2  # so there is something to coalesce
    entered = []
    block = worker.engine.coalesce_grad_reduction

    def counted() -> object:
        entered.append(1)
        return block()

    worker.engine.coalesce_grad_reduction = counted
    batch = _batch(pad_id=0)
    if cfg.old_log_prob_pass:  # several epochs or mini-batches: the policy that sampled is not the updated one
        batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    return worker, worker.update_actor(batch), len(entered)


def _weights(worker: PolicyWorker) -> list:
    """The trained weights, whole (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(worker.engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=worker.cfg.zero.stage == 3):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize(("zero", "actor", "steps"), [
    ({"stage": 1}, {}, 1), ({"stage": 2}, {}, 1), ({"stage": 3}, {}, 1), ({"stage": 2, "offload": "cpu"}, {}, 1),
    ({"stage": 2}, {"ppo_epochs": 2, "ppo_mini_batch_size": 1, "micro_batch_size_per_gpu": 2}, 4),
], ids=["zero1", "zero2", "zero3", "zero2-offload", "zero2-two-epochs-of-two-mini-batches"])
def test_one_reduction_pass_makes_the_same_update(zero: dict, actor: dict, steps: int) -> None:
    plain_worker, plain, plain_blocks = _update(zero, actor)
    coalesced_worker, coalesced, blocks = _update({**zero, "coalesce_grad_reduction": True}, actor)
    assert (plain_blocks, blocks) == (0, steps)  # one coalesced block an optimizer step, none without the key
    assert coalesced_worker.engine.global_steps == plain_worker.engine.global_steps == steps
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert coalesced[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert plain["actor/grad_norm"] > 0
    names = [name for name, _ in plain_worker.engine.module.named_parameters()]
    for name, a, b in zip(names, _weights(plain_worker), _weights(coalesced_worker), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_stage_zero_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=re.escape("zero.coalesce_grad_reduction: DeepSpeed coalesces the reduction "
                                                    "of ZeRO-1..3 only")):
        from_dict({"zero": {"stage": 0, "coalesce_grad_reduction": True}})
