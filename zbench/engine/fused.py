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

import types
from typing import Any

import torch
import torch.nn.functional as F

_SILU_CLASSES = {"SiLU", "SiLUActivation"}


def _rms(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x · rstd rounded to x's dtype, rstd in float32) over the last dimension."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)


def _rms_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The gradient through x · rstd for the gradient of its (rounded) result, in float32, as x's dtype."""
    if x.is_cuda:  # one fused kernel; PyTorch registers it for CUDA only
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


def is_rms_norm(module: torch.nn.Module) -> bool:
    """A Hugging Face RMSNorm: a 1-D weight scaling the input normalised by its root mean square."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and not hasattr(module, "bias"))


def is_swiglu_mlp(module: torch.nn.Module) -> bool:
    """A gated MLP computing down(silu(gate(x)) · up(x)), as Llama, Qwen2 and Qwen3 do."""
    return (all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in _SILU_CLASSES)


def fuse(model: torch.nn.Module) -> dict[str, int]:
    """Give every RMSNorm and SwiGLU MLP of `model` the lean forward (once; a second call changes nothing).
    Returns how many modules of each kind now have it."""
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        for kind, test, forward in (("rms_norm", is_rms_norm, _norm_forward), ("swiglu", is_swiglu_mlp, _mlp_forward)):
            if test(module):
                module.forward = types.MethodType(forward, module)
                counts[kind] += 1
    return counts
