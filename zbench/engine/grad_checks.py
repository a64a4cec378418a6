"""The gradient checks before a ZeRO-1/2 optimizer step as multi-tensor reductions (`zero.fused_grad_checks`).

Before each optimizer step, DeepSpeed 0.19's ZeRO-1/2 optimizer (`DeepSpeedZeroOptimizer`) looks at its partition's
gradients twice, one tensor at a time:

- in bf16 with `check_grad_overflow` (its default) or fp16, for a non-finite value: `amax`, `amin`, two `isfinite`,
  a logical and, a count (`has_overflow_partitioned_grads_serial`);
- for gradient clipping, the L2 norm: each gradient copied to fp64, then its norm (`get_grad_norm_direct`).

For Qwen3-0.6B's 310 tensors that is some 5,000 device ops of a few microseconds each, every one launched from
Python: on one H200 the GPU idled 27.5 ms of a 1.0 s GRPO update in gaps that began under `aten::isfinite` alone,
and fusing the checks made the update 5-8 % faster (results/reference/h200-grad-checks-20261202). Here each check is
one `torch._foreach_norm` over the same gradients, in fp64 as DeepSpeed's norm is:

- a non-finite value anywhere makes its tensor's L2 norm non-finite, and no finite bf16 or fp16 value can overflow
  a sum of squares in fp64, so "some norm is not finite" is exactly DeepSpeed's test;
- the norm is DeepSpeed's: per-tensor fp64 norms, squared, summed, in fp32 across the data-parallel ranks, the
  square root, and a non-finite result masked as DeepSpeed masks it. Only the order of the fp64 summation inside a
  tensor differs.

What stays DeepSpeed's: the cross-rank reductions, loss scaling, skipping a step on overflow, the optimizer. It
applies where those two methods do what is described above: DeepSpeed 0.19 (`CHECKED_DEEPSPEED`), its ZeRO-1/2
optimizer itself (not a subclass), without optimizer offload (which checks its gradients on the host as it copies
them), without tensor or pipeline parallelism (whose norms count a parameter on some ranks only, which zbench never
runs), on a device with fp64 norms (in fp32 a finite bf16 value can overflow its own norm). Elsewhere, ZeRO-0 and 3
included, DeepSpeed's own checks run: ZeRO-3 already checks its flat gradient buffer in two kernels.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# DeepSpeed releases whose ZeRO-1/2 step was read for the equivalence above: another one keeps its own checks
CHECKED_DEEPSPEED = ("0.19",)


def fuse_grad_checks(engine: Any) -> str:
    """Give `engine`'s ZeRO-1/2 optimizer the fused checks, where they apply (see the module's docstring); returns
    what the engine's steps check with, for the case's record: "fused", or "deepspeed (<why>)"."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    release = ".".join(deepspeed.__version__.split(".")[:2])
    if release not in CHECKED_DEEPSPEED:
        return f"deepspeed (its {deepspeed.__version__} step was not checked against the fused one)"
    opt = getattr(engine, "optimizer", None)
    if type(opt) is not DeepSpeedZeroOptimizer:  # ZeRO-0 and 3, and subclasses (ZenFlow) with steps of their own
        return f"deepspeed (no ZeRO-1/2 optimizer: {type(opt).__name__})"
    if opt.cpu_offload:
        return "deepspeed (optimizer offload checks its gradients on the host)"
    if getattr(opt, "model_parallel_rank", 0) != 0 or getattr(opt, "mpu", None) is not None:
        return "deepspeed (tensor or pipeline parallel)"
    if get_norm_dtype() != torch.float64:  # in fp32 a finite bf16 gradient can overflow its own norm
        return "deepspeed (the device has no fp64 for the norms)"
    opt.has_overflow_partitioned_grads_serial = types.MethodType(_overflow, opt)
    opt.get_grad_norm_direct = types.MethodType(_norm, opt)
    return "fused"


def tensor_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's L2 norm in fp64, as one 1-D tensor: one multi-tensor reduction instead of a copy and a norm
    per tensor."""
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))


def _overflow(self: Any) -> torch.Tensor:
    """`has_overflow_partitioned_grads_serial`: whether any gradient of the partition holds a non-finite value, as a
    one-element bool tensor on the device."""
    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=torch.device(self.device))
    return ~torch.isfinite(tensor_norms(grads)).all().reshape(1)


def _norm(self: Any, gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2) -> torch.Tensor:
    """`get_grad_norm_direct` for the L2 norm (DeepSpeed's own for any other): the partition's gradients but those
    marked as padding, each tensor's norm in fp64, squared and summed, the sum in fp32 across the data-parallel
    ranks, its square root, a non-finite result masked as DeepSpeed masks it."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if float(norm_type) != 2.0:
        return DeepSpeedZeroOptimizer.get_grad_norm_direct(self, gradients, params, norm_type)
    grads = [g.detach() for g in gradients if not getattr(g, "_zero_padding", False)]
    if grads:
        total = tensor_norms(grads).pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32, device=torch.device(self.device))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total
