"""`zero.fused_grad_checks`: the ZeRO-1/2 optimizer step's non-finite check and gradient norm as multi-tensor
reductions give DeepSpeed's own answers on the same gradients (finite, with an inf, with a NaN) and the same update;
where they do not apply, DeepSpeed's run and the record says why (real DeepSpeed on CPU, the embedded tiny model, one
rank)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from test_coalesce_grad_reduction import _weights
from test_old_log_prob import _batch, _cfg

from zbench.config import from_dict
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _worker(zero: dict) -> PolicyWorker:
    worker = PolicyWorker(from_dict(_cfg(zero=zero)), 0, 1, tempfile.mkdtemp(prefix="zbench-gradchecks-"),
                          str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    return worker


def test_fused_checks_answer_as_deepspeed_and_update_the_same() -> None:
    """At the step's norm, on the gradients DeepSpeed reduced: the fused norm equals DeepSpeed's per-tensor one,
    and the fused non-finite check agrees with DeepSpeed's on them as they are, with one inf, and with one NaN
    placed in a gradient; the update then matches one run with DeepSpeed's own checks."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    fused = _worker({"stage": 2})
    assert fused.grad_checks == "fused"
    opt = fused.engine.optimizer
    fused_norm = opt.get_grad_norm_direct
    seen: list[tuple[Any, ...]] = []

    def checked_norm(gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
        norm = fused_norm(gradients, params, norm_type)
        theirs = DeepSpeedZeroOptimizer.get_grad_norm_direct(opt, gradients, params, norm_type)
        flags = []
        grad = next(g for g in gradients if g.numel() > 1)
        for bad in (None, float("inf"), float("nan")):
            kept = grad.flatten()[1].clone()
            if bad is not None:
                grad.view(-1)[1] = bad
            flags.append((bool(opt.has_overflow_partitioned_grads_serial()),
                          bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt))))
            grad.view(-1)[1] = kept
        seen.append((float(norm), float(theirs), flags))
        return norm

    opt.get_grad_norm_direct = checked_norm
    stats = fused.update_actor(_batch(pad_id=0))
    [(ours, theirs, flags)] = seen  # one optimizer step, one norm
    assert ours > 0 and ours == pytest.approx(theirs, rel=1e-6)
    assert flags == [(False, False), (True, True), (True, True)]
    plain = _worker({"stage": 2, "fused_grad_checks": False})
    assert plain.grad_checks == "deepspeed (off)"
    assert plain.update_actor(_batch(pad_id=0))["actor/grad_norm"] == pytest.approx(stats["actor/grad_norm"], rel=1e-6)
    for a, b in zip(_weights(plain), _weights(fused), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


@pytest.mark.parametrize(("zero", "why"), [
    ({"stage": 3}, "deepspeed (no ZeRO-1/2 optimizer: DeepSpeedZeroOptimizer_Stage3)"),
    ({"stage": 1, "offload": "cpu"}, "deepspeed (optimizer offload checks its gradients on the host)"),
], ids=["zero3", "zero1-offload"])
def test_where_fused_checks_do_not_apply_deepspeed_checks_and_says_why(zero: dict, why: str) -> None:
    worker = _worker(zero)
    assert worker.grad_checks == why
    assert worker.update_actor(_batch(pad_id=0))["actor/grad_norm"] > 0
