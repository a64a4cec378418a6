"""The lean RMSNorm and SwiGLU (`zbench.engine.fused`): the same numbers as Hugging Face's modules, less kept for
backward."""

from __future__ import annotations

import copy

import pytest
import torch

from zbench.engine.fused import RMSNormFunction, SiluMulFunction, fuse, is_rms_norm, is_swiglu_mlp
from zbench.models import qwen3_06b_config


def _qwen3(layers: int = 2, small: bool = True, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_06b_config()
    cfg.num_hidden_layers, cfg.vocab_size, cfg.pad_token_id = layers, 1024, 0
    if small:
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = (
            256, 512, 4, 2, 64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # norm weights away from 1, or a wrong weight gradient could hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def _grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.double() for n, p in model.named_parameters()}


def test_fuse_finds_every_norm_and_mlp_once():
    model = _qwen3()
    counts = fuse(model)
    assert counts == {"rms_norm": 2 * 4 + 1, "swiglu": 2}  # input, post-attention, q and k norms per layer; final
    assert fuse(model) == counts  # a second call changes nothing
    gelu = copy.deepcopy(model.model.layers[0].mlp)
    gelu.act_fn = torch.nn.GELU()
    assert not is_swiglu_mlp(gelu)
    assert not is_rms_norm(torch.nn.LayerNorm(8))


def test_only_modules_running_the_stock_forward_are_fused():
    """Llama's modules run Qwen3's code line for line and are fused; a norm scaling by (1 + weight) (Gemma) or
    rounding after the weight (Olmo2), or an MLP with multipliers (Falcon-H1), keeps its own forward."""
    from transformers import FalconH1Config, LlamaConfig
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    llama = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    assert is_rms_norm(LlamaRMSNorm(16)) and is_swiglu_mlp(LlamaMLP(llama))
    assert not is_rms_norm(Olmo2RMSNorm(16)) and not is_rms_norm(GemmaRMSNorm(16))
    falcon = FalconH1MLP(FalconH1Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2))
    assert not is_swiglu_mlp(falcon)
    assert fuse(falcon) == {"rms_norm": 0, "swiglu": 0}


def test_the_lean_norm_without_pytorchs_fused_op(monkeypatch):
    """Where PyTorch has no `_fused_rms_norm` (older releases) the same numbers come from plain operations."""
    from zbench.engine import fused

    model = _qwen3(dtype=torch.bfloat16)
    ids = torch.randint(0, 1024, (2, 32))
    fuse(model)
    logits, grads = _grads(model, ids)
    model.zero_grad()
    monkeypatch.setattr(fused, "_HAS_FUSED_RMS", False)
    plain_logits, plain_grads = _grads(model, ids)
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(g, plain_grads[n]) for n, g in grads.items())


def test_double_backward_is_refused_not_wrong():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(RMSNormFunction.apply(x, w, 1e-6).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_float32_forward_is_exact_and_gradients_agree():
    stock = _qwen3()
    lean = copy.deepcopy(stock)
    fuse(lean)
    ids = torch.randint(0, 1024, (2, 48))
    logits, grads = _grads(stock, ids)
    lean_logits, lean_grads = _grads(lean, ids)
    assert torch.equal(logits, lean_logits)
    for name, g in grads.items():
        assert (lean_grads[name] - g).norm() <= 1e-5 * g.norm(), name


def test_bf16_forward_is_exact_and_gradients_as_close_to_float64_as_stock():
    base = _qwen3(dtype=torch.bfloat16)
    ids = torch.randint(0, 1024, (2, 48))
    _, truth = _grads(copy.deepcopy(base).double(), ids)
    logits, stock = _grads(copy.deepcopy(base), ids)
    lean_model = copy.deepcopy(base)
    fuse(lean_model)
    lean_logits, lean = _grads(lean_model, ids)
    assert torch.equal(logits, lean_logits)
    for name, t in truth.items():
        stock_err, lean_err = (stock[name] - t).norm(), (lean[name] - t).norm()
        assert lean_err <= 1.1 * stock_err + 1e-6 * t.norm(), name


def test_swiglu_gradients_are_bitwise_the_unfused_ones():
    torch.manual_seed(1)
    gate = torch.randn(4, 64, 96, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(4, 64, 96, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 64, 96, dtype=torch.bfloat16)
    out = torch.nn.functional.silu(gate) * up
    stock = torch.autograd.grad(out, (gate, up), grad)
    lean_out = SiluMulFunction.apply(gate, up)
    lean = torch.autograd.grad(lean_out, (gate, up), grad)
    assert torch.equal(out, lean_out)
    assert all(torch.equal(a, b) for a, b in zip(stock, lean, strict=True))


def _saved_bytes_per_token(model, tokens: int) -> float:
    """Bytes one decoder layer's forward leaves autograd for backward, per token (parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    dtype = next(model.parameters()).dtype
    hidden = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)
    rope = model.model.rotary_emb(hidden, torch.arange(tokens)[None])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](hidden, position_embeddings=rope, attention_mask=None)
    return sum(saved.values()) / tokens


def test_a_qwen3_06b_layer_keeps_a_third_less_for_backward():
    stock = _qwen3(layers=1, small=False, dtype=torch.bfloat16)
    before = _saved_bytes_per_token(stock, 256)
    fuse(stock)
    after = _saved_bytes_per_token(stock, 256)
    # measured: 70.7 KB -> 44.7 KB per token; the norms' float32 copies and the SiLU output are gone
    assert after < 0.7 * before
    assert before - after >= 24 * 1024
