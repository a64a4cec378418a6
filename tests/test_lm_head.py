"""The fused LM head (`model.fused_head`) gives the plain path's log-probs, entropies and gradients: on its own against
`algos.token_logprobs_and_entropy` over materialised logits, and inside real DeepSpeed updates (ZeRO-2 and ZeRO-3,
the embedded tiny model, whose head is tied to its embedding) against the same update with the plain head. So does
the head that takes the loss itself and forms its gradient in forward (`model.head_loss_in_forward`)."""

from __future__ import annotations

import re
import tempfile
from unittest import mock

import pytest
import torch
from test_loss_agg import _moved_apart
from test_old_log_prob import _batch, _cfg
from transformers import AutoConfig, AutoModelForCausalLM

from zbench.config import ConfigError, from_dict
from zbench.engine import algos, lm_head
from zbench.engine.cluster import free_port
from zbench.engine.lm_head import fusable_head, head_logprobs, head_loss
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


def _policy_terms(logp: torch.Tensor, ent: torch.Tensor | None, rows: slice | None, extra: dict[str, torch.Tensor],
                  coef: float) -> torch.Tensor:
    """A loss of per-token terms as the actor's: clipped policy gradient, KL to a reference, an entropy bonus."""
    def part(key: str) -> torch.Tensor:
        return extra[key] if rows is None else extra[key].reshape(-1)[rows]

    mask = part("mask")
    pg, _, _ = algos.policy_loss(part("old"), logp, part("adv"), mask, 0.2, 0.28, 3.0, denom=17.0)
    kl = algos.masked_mean(algos.kl_penalty(logp, part("ref"), "low_var_kl"), mask, denom=17.0)
    loss = pg + 0.1 * kl
    return loss - coef * algos.masked_mean(ent, mask, denom=17.0) if ent is not None else loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 21, 4096])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_loss_taken_in_the_head_equals_the_loss_after_it(temperature: float, chunk: int, entropy_grad: bool):
    """`head_loss` gives the loss the statistics of the plain path give, and the same gradients, scaled by whatever
    multiplies the loss after it; they exist once forward returns (backward would read a zeroed weight)."""
    hidden, weight, labels = _inputs(torch.float32)
    g = torch.Generator().manual_seed(2)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    with torch.no_grad():
        plain_logp = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, temperature)[0]
    extra = {"mask": mask, "adv": torch.randn(3, 7, generator=g) * mask,
             "old": plain_logp + 0.3 * torch.randn(3, 7, generator=g),  # ratios inside and outside the clip
             "ref": plain_logp + 0.2 * torch.randn(3, 7, generator=g)}
    coef = 0.05 if entropy_grad else 0.0
    logp, ent = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, temperature, with_entropy=True,
                                                 entropy_grad=entropy_grad)
    loss = _policy_terms(logp, ent, None, extra, coef)
    (0.25 * loss).backward()
    plain = (loss.detach(), hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    f_logp, f_ent, f_loss = head_loss(hidden, weight, labels, lambda lp, en, rows: _policy_terms(lp, en, rows, extra, coef),
                                      temperature, with_entropy=True, entropy_grad=entropy_grad, chunk_tokens=chunk)
    assert not f_logp.requires_grad and not f_ent.requires_grad and f_loss.requires_grad
    for a, b in ((logp, f_logp), (ent, f_ent)):  # float32 sums in another order, as above
        assert (a.detach() - b).abs().max() <= 1e-5 * a.detach().abs().max()
    with torch.no_grad():
        weight.zero_()  # the gradients were formed in forward: backward projects nothing
    (0.25 * f_loss).backward()
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), plain, (f_loss.detach(), hidden.grad, weight.grad),
                          strict=True):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), name
    assert plain[1].abs().max() > 0 and plain[2].abs().max() > 0


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
    """One GRPO update of the same batch from the same weights (KL loss and an entropy bonus, two micro-batches),
    with the plain head, the fused head, and the fused head taking the loss itself: the same statistics, the same
    returned log-probs and the same weights after the step (DeepSpeed on CPU; ZeRO-3 gathers the tied head for
    forward and again for backward)."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-head-")
    workers = []
    for fused, in_forward in ((False, False), (True, False), (True, True)):
        cfg = from_dict(_cfg(zero={"stage": stage}, model={"fused_head": fused, "head_loss_in_forward": in_forward},
                             actor={"entropy_coeff": 0.01, "micro_batch_size_per_gpu": 4}))
        worker = PolicyWorker(cfg, 0, 1, case_dir, model_path)
        if not workers:
            worker.join("127.0.0.1", free_port())
        info = worker.setup()
        assert (info["fused_head"], info["head_loss_in_forward"]) == (fused, in_forward)
        workers.append(worker)
    batch = _batch(pad_id=0)
    plain, *others = (w.update_actor(batch) for w in workers)
    plain_logp = plain.pop("old_log_probs")
    assert plain["actor/grad_norm"] > 0
    for other in others:
        assert torch.allclose(other.pop("old_log_probs"), plain_logp, atol=1e-5)
        assert other.keys() == plain.keys()
        for key in plain:
            assert other[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    before, *after = (dict(_full_params(w)) for w in workers)  # the weights after the step, whole on this rank
    # Adam's first step moves a weight by about lr (1e-3) where its gradient is well above eps, whatever its size: a
    # gradient that differs moves weights 1e-4 apart and more, while sums in another order leave a few weights whose
    # gradient is near eps some 1e-6 apart
    for name, p in before.items():
        for weights in after:
            assert torch.allclose(p, weights[name], atol=1e-5), name


@pytest.mark.parametrize(("loss_agg", "kl_type"), [("token-mean", "mse"), ("micro-token-mean", "low_var_kl")])
def test_the_head_takes_the_loss_with_ratios_clipped_and_a_reference_near(loss_agg: str, kl_type: str):
    """The update fed old log-probs (ratios away from 1, some clipped, dual clip on), a reference close to the policy
    (the KL term unclamped), temperature 0.7, an entropy bonus, four micro-batches and token chunks of 5 that split
    rows: the head that takes the loss gives the statistics, gradient norm and weights of the loss taken after it."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-head-")
    batch = _batch(pad_id=0)
    g = torch.Generator().manual_seed(5)
    results, old = [], None
    for in_forward in (False, True):
        raw = _cfg(model={"head_loss_in_forward": in_forward}, rollout={"temperature": 0.7},
                   actor={"entropy_coeff": 0.02, "micro_batch_size_per_gpu": 2, "clip_ratio_c": 3.0,
                          "kl_loss_type": kl_type, "loss_agg": loss_agg, "recompute_old_log_prob": "always"})
        worker = PolicyWorker(from_dict(raw), 0, 1, case_dir, model_path)
        if not results:
            worker.join("127.0.0.1", free_port())
        worker.setup()
        if old is None:
            policy = worker.compute_log_prob(batch)["old_log_probs"]
            noise = torch.randn(policy.shape, generator=g) * batch["response_mask"]
            old = policy + 0.4 * noise
            batch["ref_log_probs"] = policy - 0.3 * noise.roll(1, 0)
        with mock.patch.object(lm_head, "DEFAULT_CHUNK_TOKENS", 5):
            stats = worker.update_actor({**batch, "old_log_probs": old})
        results.append((stats, dict(_full_params(worker))))
    (plain, plain_w), (fused, fused_w) = results
    assert plain["actor/pg_clipfrac"] > 0.05 and 0 < plain["actor/kl_loss"] < 1  # clipping on, KL off its clamp
    assert fused.keys() == plain.keys()
    for key in plain:
        assert fused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    # the share of weights apart, as tests/test_loss_agg.py counts it: where a gradient is near Adam's eps, rounding
    # moves its weight measurably (a dozen of 131k here; unequal gradients move about one in ten)
    assert _moved_apart(list(fused_w.values()), list(plain_w.values())) < 1e-3


def test_the_head_takes_the_loss_only_when_it_is_fused():
    with pytest.raises(ConfigError, match=re.escape("model.head_loss_in_forward: needs model.fused_head=true")):
        from_dict({"model": {"fused_head": False, "head_loss_in_forward": True}})


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
    # the head that takes a loss of these statistics itself (compiled kernels, gradients formed in forward, scaled)
    hidden.grad = weight.grad = None
    for entropy_grad in (True, False):
        def token_loss(lp: torch.Tensor, en: torch.Tensor | None, rows: slice | None,
                       with_ent: bool = entropy_grad) -> torch.Tensor:
            wl, we = (w_logp, w_ent) if rows is None else (w_logp.reshape(-1)[rows], w_ent.reshape(-1)[rows])
            return (lp * wl).sum() + ((en * we).sum() if with_ent and en is not None else 0.0)

        logp, ent = algos.token_logprobs_and_entropy(hidden @ weight.t(), labels, 0.7, with_entropy=True,
                                                     entropy_grad=entropy_grad)
        (token_loss(logp, ent, None) / 3).backward()
        plain = (hidden.grad.float(), weight.grad.float())
        hidden.grad = weight.grad = None
        *_, loss = head_loss(hidden, weight, labels, token_loss, 0.7, with_entropy=True, entropy_grad=entropy_grad,
                             chunk_tokens=256)
        (loss / 3).backward()
        for name, a, b in zip(("hidden grad", "weight grad"), plain, (hidden.grad.float(), weight.grad.float()),
                              strict=True):
            assert (a - b).abs().max() <= 1e-2 * a.abs().max(), (name, entropy_grad)
        hidden.grad = weight.grad = None
