"""Leaner autograd for the two blocks of a Qwen3/Llama-style decoder that keep the most for backward.

Hugging Face's RMSNorm upcasts its input to float32 and leaves autograd four tensors per call (the float32
input twice over, the per-row scale, and the bf16 result the weight multiplies); its SwiGLU MLP keeps the gate,
the up projection and the SiLU of the gate. Per token and layer of Qwen3-0.6B that is about 30 KB of the ~75 KB
a training forward keeps, and on CUDA the norm alone is seven kernels forward and a dozen backward.

`fuse(model)` swaps the forward of those modules for autograd functions that keep only what backward cannot
recompute cheaply:

- RMSNorm keeps its bf16 input and the float32 per-row scale; the forward is PyTorch's fused RMSNorm kernel
  (`aten._fused_rms_norm`: one kernel on CUDA) and backward its fused gradient. The normalised value is
  rounded to the input dtype before the weight multiplies it, as in Hugging Face's module.
- SwiGLU (`silu(gate) * up`) keeps gate and up and recomputes the SiLU in backward; forward and gradients are
  bitwise those of the unfused code (the same kernels on the same inputs).

Parameters are untouched and reached through the module at call time, so ZeRO-3's gather hooks still see
each module run.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

_SILU_CLASSES = {"SiLU", "SiLUActivation"}
_HAS_FUSED_RMS = hasattr(torch.ops.aten, "_fused_rms_norm") and hasattr(torch.ops.aten, "_fused_rms_norm_backward")


def _rms(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x · rstd rounded to x's dtype, rstd in float32) over the last dimension."""
    if _HAS_FUSED_RMS:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype), rstd


def _rms_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The gradient through x · rstd for the gradient of its (rounded) result, in float32, as x's dtype."""
    if x.is_cuda and _HAS_FUSED_RMS and grad.dtype == x.dtype:  # one fused kernel; PyTorch has it for CUDA only
        return torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, None, [True, False])[0].to(x.dtype)
    scaled, g = x.float() * rstd, grad.float()
    return ((g - scaled * (scaled * g).mean(-1, keepdim=True)) * rstd).to(x.dtype)


class RMSNormFunction(torch.autograd.Function):
    """weight · (x / rms(x)).to(x.dtype), keeping x and the per-row scale for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = _rms(x, eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * normed

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            normed = (x.float() * rstd).to(x.dtype)  # what forward multiplied the weight by, recomputed
            grad_w = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
        if ctx.needs_input_grad[0]:
            grad_x = _rms_backward(grad * weight, x, rstd)
        return grad_x, grad_w, None


class SiluMulFunction(torch.autograd.Function):
    """silu(gate) · up, keeping gate and up (not the SiLU) for backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        return grad_gate, grad_up


def _norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(SiluMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _code(fn: Callable[..., Any]) -> tuple[bytes, tuple[Any, ...], tuple[str, ...]]:
    code = fn.__code__
    return code.co_code, code.co_consts, code.co_names


@functools.cache
def _stock_forwards() -> dict[str, tuple[bytes, tuple[Any, ...], tuple[str, ...]]]:
    """The code of the forwards this module reproduces: Qwen3's RMSNorm and MLP, which Llama, Qwen2, Mistral and
    others share line for line. A module qualifies only if its class runs exactly that code: a norm that scales by
    (1 + weight) or rounds elsewhere, or an MLP with multipliers, clamps or dropout, is left alone."""
    from transformers.models.qwen3 import modeling_qwen3 as q

    return {"rms_norm": _code(q.Qwen3RMSNorm.forward), "swiglu": _code(q.Qwen3MLP.forward)}


def _runs_stock(module: torch.nn.Module, kind: str) -> bool:
    forward = getattr(type(module), "forward", None)
    return callable(forward) and hasattr(forward, "__code__") and _code(forward) == _stock_forwards()[kind]


def is_rms_norm(module: torch.nn.Module) -> bool:
    """A Hugging Face RMSNorm: a 1-D weight scaling the input normalised by its root mean square, rounded to the
    input's dtype first, as Llama's and Qwen's do."""
    weight = getattr(module, "weight", None)
    return (isinstance(getattr(module, "variance_epsilon", None), float) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and _runs_stock(module, "rms_norm"))


def is_swiglu_mlp(module: torch.nn.Module) -> bool:
    """A gated MLP computing down(silu(gate(x)) · up(x)) and nothing else, as Llama, Qwen2 and Qwen3 do."""
    return (all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in _SILU_CLASSES and _runs_stock(module, "swiglu"))


def fuse(model: torch.nn.Module) -> dict[str, int]:
    """Give every RMSNorm and SwiGLU MLP of `model` the lean forward (once; a second call changes nothing).
    Returns how many modules of each kind now have it."""
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        for kind, test, forward in (("rms_norm", is_rms_norm, _norm_forward), ("swiglu", is_swiglu_mlp, _mlp_forward)):
            lean = getattr(module.forward, "__func__", None) is forward
            if lean or test(module):
                module.forward = types.MethodType(forward, module)
                counts[kind] += 1
    return counts
