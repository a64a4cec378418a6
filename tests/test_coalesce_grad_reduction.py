"""`zero.coalesce_grad_reduction`: a mini-batch's micro-batches reduced in one pass after the last backward
(DeepSpeed's `engine.coalesce_grad_reduction`) make the same update as DeepSpeed's per-micro-batch reduction, at
ZeRO-1, 2 and 3 and with the optimizer offloaded (real DeepSpeed on CPU, the embedded tiny model, two micro-batches
a step); stage 0 is refused by name."""

from __future__ import annotations

import re
import tempfile

import pytest
from test_old_log_prob import _batch, _cfg, assert_same_update

from zbench.config import ConfigError, from_dict
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _update(zero: dict) -> tuple[PolicyWorker, dict]:
    """A worker with these `zero` settings (the same initial weights every time) after one GRPO update."""
    cfg = from_dict(_cfg(zero=zero))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-coalesce-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    assert worker.engine.gradient_accumulation_steps() == 2  # so there is something to coalesce
    return worker, worker.update_actor(_batch(pad_id=0))


def _weights(worker: PolicyWorker) -> list:
    """The trained weights, whole (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(worker.engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=worker.cfg.zero.stage == 3):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 2, "offload": "cpu"}],
                         ids=["zero1", "zero2", "zero3", "zero2-offload"])
def test_one_reduction_pass_makes_the_same_update(zero: dict) -> None:
    plain_worker, plain = _update(zero)
    coalesced_worker, coalesced = _update({**zero, "coalesce_grad_reduction": True})
    assert coalesced_worker.engine.global_steps == plain_worker.engine.global_steps == 1  # one optimizer step each
    names = [name for name, _ in plain_worker.engine.module.named_parameters()]
    assert_same_update(plain, coalesced, (zip(names, _weights(plain_worker), strict=True),
                                          _weights(coalesced_worker)), atol=1e-6)


def test_stage_zero_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=re.escape("zero.coalesce_grad_reduction: DeepSpeed coalesces the reduction "
                                                    "of ZeRO-1..3 only")):
        from_dict({"zero": {"stage": 0, "coalesce_grad_reduction": True}})
