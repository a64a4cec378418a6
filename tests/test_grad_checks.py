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


def _worker(zero: dict, model: dict | None = None) -> PolicyWorker:
    worker = PolicyWorker(from_dict(_cfg(zero=zero, model=model or {})), 0, 1,
                          tempfile.mkdtemp(prefix="zbench-gradchecks-"), str(resolve_model("tiny")))
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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "deepspeed"])
def test_a_non_finite_gradient_skips_the_bf16_step(fused: bool) -> None:
    """In bf16 DeepSpeed checks for non-finite gradients before each step: one NaN in one parameter's gradient
    makes the step a skipped one, the weights untouched, with the fused check (which that step must call) as with
    DeepSpeed's own; a finite bf16 step changes the weights."""
    worker = _worker({"stage": 2, "fused_grad_checks": fused}, {"dtype": "bf16"})
    assert worker.grad_checks == ("fused" if fused else "deepspeed (off)")
    opt = worker.engine.optimizer
    assert opt.check_grad_overflow and next(worker.engine.module.parameters()).dtype == torch.bfloat16
    checks = opt.has_overflow_partitioned_grads_serial
    calls: list[bool] = []

    def counted() -> torch.Tensor:
        flag = checks()
        calls.append(bool(flag))
        return flag

    opt.has_overflow_partitioned_grads_serial = counted
    param = next(p for p in worker.engine.module.parameters() if p.requires_grad)

    def one_nan(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    before = _weights(worker)
    handle = param.register_hook(one_nan)
    worker.update_actor(_batch(pad_id=0))
    handle.remove()
    assert calls == [True] and worker.engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(worker), strict=True))
    worker.update_actor(_batch(pad_id=0))
    assert calls == [True, False] and worker.engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(worker), strict=True))


def test_fused_checks_match_deepspeed_on_mixed_gradient_lists() -> None:
    """The fused methods against DeepSpeed's own, called on the same lists: bf16 and fp32 tensors, an empty one, one
    marked as ZeRO padding (left out of the norm), none at all, and the inf-norm that stays DeepSpeed's; the
    non-finite check over two parameter groups, one holding a None, with an inf, a -inf or a NaN in the other."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    worker = _worker({"stage": 2})
    opt = worker.engine.optimizer
    g = torch.Generator().manual_seed(5)
    padding = torch.randn(7, generator=g)
    padding._zero_padding = True  # type: ignore[attr-defined]
    grads = [torch.randn(300, generator=g).bfloat16(), torch.randn(4, 5, generator=g), torch.empty(0), padding]
    params = list(worker.engine.module.parameters())[: len(grads)]
    ours, theirs = opt.get_grad_norm_direct, DeepSpeedZeroOptimizer.get_grad_norm_direct.__get__(opt)
    for case in (grads, grads[:1], []):
        assert float(ours(case, params)) == pytest.approx(float(theirs(case, params)), rel=1e-6), len(case)
    finite = grads[:2]  # DeepSpeed's own inf-norm, which both call, fails on an empty tensor
    assert float(ours(finite, params, float("inf"))) == float(theirs(finite, params, float("inf")))
    saved_groups, saved_grads = opt.bit16_groups, opt.averaged_gradients
    try:
        opt.bit16_groups = [[], []]
        for bad in (None, float("inf"), float("-inf"), float("nan")):
            second = torch.randn(9, generator=g).bfloat16()
            if bad is not None:
                second[3] = bad
            opt.averaged_gradients = {0: [grads[0], None], 1: [second, grads[2]]}
            assert bool(opt.has_overflow_partitioned_grads_serial()) == (bad is not None)
            assert bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt)) == (bad is not None)
    finally:
        opt.bit16_groups, opt.averaged_gradients = saved_groups, saved_grads
