"""The fused LM head (`model.fused_head`) gives the plain path's log-probs, entropies and gradients: on its own against
`algos.token_logprobs_and_entropy` over materialised logits, and inside real DeepSpeed updates (ZeRO-2 and ZeRO-3,
the embedded tiny model, whose head is tied to its embedding) against the same update with the plain head."""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg
from transformers import AutoConfig, AutoModelForCausalLM

from zbench.config import from_dict
from zbench.engine import algos
from zbench.engine.cluster import free_port
from zbench.engine.lm_head import fusable_head, head_logprobs
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, 50, (3, 7), generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 21, 4096])
def test_statistics_and_gradients_equal_the_plain_path(temperature: float, chunk: int):
    hidden, weight, labels = _inputs(torch.float32)
    g = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)  # any upstream gradients
    results = []
    for fused in (False, True):
        if fused:
            logp, ent = head_logprobs(hidden, weight, labels, temperature, with_entropy=True, chunk_tokens=chunk)
        else:
            logp, ent = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, temperature, with_entropy=True)
        (logp * w_logp + ent * w_ent).sum().backward()
        results.append((logp.detach(), ent.detach(), hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    for name, plain, fused in zip(("logp", "entropy", "hidden grad", "weight grad"), *results, strict=True):
        assert fused.shape == plain.shape and fused.dtype == plain.dtype, name
        # float32 sums in another order: equal to a few units in the last place of the largest entry
        assert (fused - plain).abs().max() <= 1e-5 * plain.abs().max(), name
    assert results[0][0].max() < 0 and results[0][1].min() > 0  # real log-probs and entropies, not zeros


def test_entropy_without_gradient_and_log_probs_alone():
    hidden, weight, labels = _inputs(torch.float32)
    logp, ent = head_logprobs(hidden, weight, labels, with_entropy=True, entropy_grad=False, chunk_tokens=5)
    assert not ent.requires_grad
    logp.sum().backward()
    with_ent = hidden.grad.clone()
    hidden.grad = weight.grad = None
    only, none = head_logprobs(hidden, weight, labels)  # no entropy asked: log-probs and None
    assert none is None and torch.allclose(only, logp, atol=1e-5)
    only.sum().backward()
    assert torch.allclose(hidden.grad, with_ent)
    with pytest.raises(ValueError, match=r"hidden \(3, 7, 16\) does not match labels \(3, 6\)"):
        head_logprobs(hidden, weight, labels[:, :6])


def test_bf16_values_match_the_plain_path():
    """In bf16 the logits are rounded to bf16 before the float32 reduction in both paths: the same values."""
    hidden, weight, labels = _inputs(torch.bfloat16)
    with torch.no_grad():
        plain = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, with_entropy=True)
        fused = head_logprobs(hidden, weight, labels, with_entropy=True, chunk_tokens=4)
    assert torch.allclose(fused[0], plain[0], atol=1e-5) and torch.allclose(fused[1], plain[1], atol=1e-4)


def test_only_a_plain_linear_head_is_fused():
    tiny = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    assert fusable_head(tiny) is tiny.lm_head
    config = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    assert config.final_logit_softcapping  # Gemma 2 soft-caps its logits: the statistics need the plain path
    assert fusable_head(AutoModelForCausalLM.from_config(config)) is None


@pytest.mark.parametrize("stage", [2, 3])
def test_update_with_the_fused_head_equals_the_plain_one(stage: int):
    """One GRPO update of the same batch from the same weights, fused head on and off: the same statistics, the
    same returned log-probs and the same weights after the step (DeepSpeed on CPU; ZeRO-3 gathers the tied
    head for forward and again for backward)."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-head-")
    workers = []
    for fused in (False, True):
        cfg = from_dict(_cfg(zero={"stage": stage}, model={"fused_head": fused}))
        worker = PolicyWorker(cfg, 0, 1, case_dir, model_path)
        if not workers:
            worker.join("127.0.0.1", free_port())
        worker.setup()
        workers.append(worker)
    batch = _batch(pad_id=0)
    plain, fused = (w.update_actor(batch) for w in workers)
    assert torch.allclose(fused.pop("old_log_probs"), plain.pop("old_log_probs"), atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert fused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert plain["actor/grad_norm"] > 0
    assert fusable_head(workers[1].engine) is not None  # the fused path did run
    before, after = (dict(_full_params(w)) for w in workers)  # the weights after the step, whole on this rank
    for name, p in before.items():
        assert torch.allclose(p, after[name], atol=1e-6), name


def _full_params(worker: PolicyWorker) -> list[tuple[str, torch.Tensor]]:
    import deepspeed

    params = list(worker.engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=worker.cfg.zero.stage == 3):
        return [(n, p.detach().clone()) for n, p in params]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on CUDA only")
def test_compiled_kernels_on_cuda_equal_the_plain_path():
    """On CUDA the per-chunk reductions are compiled: bf16 statistics and gradients as the plain path's, over a
    vocabulary of Qwen3's size, a temperature and an uneven last chunk."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(2, 300, 256, device="cuda", generator=g) / 4).bfloat16().requires_grad_()
    weight = (torch.randn(151936, 256, device="cuda", generator=g) / 4).bfloat16().requires_grad_()
    labels = torch.randint(0, 151936, (2, 300), device="cuda", generator=g)
    w_logp, w_ent = torch.randn(2, 300, device="cuda", generator=g), torch.randn(2, 300, device="cuda", generator=g)
    results = []
    for fused in (False, True):
        if fused:
            logp, ent = head_logprobs(hidden, weight, labels, 0.7, with_entropy=True, chunk_tokens=256)
        else:
            logp, ent = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, 0.7, with_entropy=True)
        (logp * w_logp + ent * w_ent).sum().backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float()))
        hidden.grad = weight.grad = None
    for name, plain, fused in zip(("logp", "entropy", "hidden grad", "weight grad"), *results, strict=True):
        assert (fused - plain).abs().max() <= 1e-2 * plain.abs().max(), name  # bf16 gradients, summed per chunk
