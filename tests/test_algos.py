"""The PPO / GRPO tensor functions against values worked out by hand in each test."""

import math

import pytest
import torch

from zbench.engine import algos


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_masked_mean_ignores_padding_and_empty_masks():
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(algos.masked_mean(x, mask), 2.0)
    close(algos.masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(algos.masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten_unbiased_and_shift_mean():
    x = torch.tensor([2.0, 4.0, 6.0, 50.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 4, Bessel-corrected variance (4 + 0 + 4) / 2 = 4, std 2
    close(algos.masked_whiten(x, mask)[:3], [-1.0, 0.0, 1.0], atol=1e-4)
    close(algos.masked_whiten(x, mask, shift_mean=False)[:3], [3.0, 4.0, 5.0], atol=1e-4)


def test_gae_by_hand_with_padding():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])  # 9.0 sits on padding and must not be bootstrapped
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = algos.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # t=1: delta = 1 + 0.9*0 - 0.2 = 0.8;  t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.72*0.8 = 0.256
    close(adv, [[0.256, 0.8, 0.0]])
    close(ret, [[0.756, 1.0, 0.0]])
    whitened, ret_w = algos.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # two valid values whiten to -+1/sqrt(2) with the unbiased variance; returns are not whitened
    close(whitened, [[-math.sqrt(0.5), math.sqrt(0.5), 0.0]], atol=1e-4)
    close(ret_w, ret)


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[1.0, 1.0, 1.0]])
    adv, ret = algos.compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False)
    close(ret, [[6.0, 5.0, 3.0]])
    close(adv, [[5.0, 4.0, 2.0]])


def _gae_torch_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                    lam: float) -> torch.Tensor:
    """The GAE recurrence written out with torch row operations: the definition the host scan must match."""
    next_value, last_gae, out = torch.zeros(values.shape[0]), torch.zeros(values.shape[0]), []
    for t in reversed(range(values.shape[1])):
        gae = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last_gae
        m = mask[:, t]
        next_value = values[:, t] * m + next_value * (1 - m)
        last_gae = gae * m + last_gae * (1 - m)
        out.append(last_gae)
    return torch.stack(out[::-1], dim=1)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
def test_gae_scan_equals_the_recurrence_to_the_bit(gamma, lam):
    g = torch.Generator().manual_seed(3)
    rows, width = 64, 512
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    mask[5, 10:20] = 0  # padding inside a response carries the running values through
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=g)
    values = torch.randn(rows, width, generator=g)
    adv, ret = algos.compute_gae(rewards, values, mask, gamma, lam, whiten=False)
    expected = _gae_torch_scan(rewards, values, mask, gamma, lam)
    assert torch.equal(adv, expected * mask)
    assert torch.equal(ret, (expected + values) * mask)
    assert adv.dtype == values.dtype


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([7, 7, 3, 3, 9])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 1]])
    adv, ret = algos.compute_grpo_advantages(scores, groups, mask, eps=1e-6)
    s = 0.5 / math.sqrt(0.5)  # group 7: mean 0.5, unbiased std sqrt(0.5)
    expected = [[s, s], [-s, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.5 / (1 + 1e-6)]]
    close(adv, expected, atol=1e-4)  # equal scores give 0; a single sample keeps its raw score
    close(ret, adv)
    adv_raw, _ = algos.compute_grpo_advantages(scores, groups, mask, norm_by_std=False)
    close(adv_raw, [[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.5]])


def test_rloo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.5])
    groups = torch.tensor([4, 4, 4, 8, 9])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1], [1, 1]])
    adv, ret = algos.compute_rloo_advantages(scores, groups, mask)
    # group 4: each score minus the mean of the two others; group 8 and 9 have one sample: no baseline
    expected = [[1 - 0.25, 1 - 0.25], [0 - 0.75, 0.0], [0.0, 0.0], [0.0, 2.0], [0.5, 0.5]]
    close(adv, expected)
    close(ret, adv)


def test_compute_advantages_picks_the_estimator():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5]])
    mask = torch.ones(3, 2)
    groups = torch.tensor([0, 0, 0])
    values = torch.zeros(3, 2)
    close(algos.compute_advantages("gae", rewards, mask, values=values)[0],
          algos.compute_gae(rewards, values, mask, 1.0, 1.0)[0])
    close(algos.compute_advantages("grpo", rewards, mask, group_ids=groups)[0],
          algos.compute_grpo_advantages(rewards.sum(-1), groups, mask)[0])
    close(algos.compute_advantages("rloo", rewards, mask, group_ids=groups)[0],
          algos.compute_rloo_advantages(rewards.sum(-1), groups, mask)[0])
    with pytest.raises(ValueError, match="needs the critic's values"):
        algos.compute_advantages("gae", rewards, mask)
    with pytest.raises(ValueError, match="unknown adv_estimator"):
        algos.compute_advantages("vtrace", rewards, mask, group_ids=groups)


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    close(algos.kl_penalty(lp, ref, "k1"), [0.5])
    close(algos.kl_penalty(lp, ref, "kl"), [0.5])
    close(algos.kl_penalty(lp, ref, "abs"), [0.5])
    close(algos.kl_penalty(lp, ref, "k2"), [0.125])
    close(algos.kl_penalty(lp, ref, "mse"), [0.125])
    k3 = math.exp(-0.5) + 0.5 - 1  # r - log r - 1 with log r = ref - lp = -0.5
    close(algos.kl_penalty(lp, ref, "k3"), [k3])
    close(algos.kl_penalty(lp, ref, "low_var_kl"), [k3])
    close(algos.kl_penalty(ref, lp, "abs"), [0.5])


def test_k3_is_clamped_and_finite():
    far = algos.kl_penalty(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "low_var_kl")
    close(far, [10.0, 10.0])
    with pytest.raises(ValueError, match="low_var_kl"):
        algos.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_policy_loss_by_hand():
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac, ppo_kl = algos.policy_loss(torch.zeros(1, 4), ratio.log(), adv, mask, 0.2, 0.2)
    # per token: max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5, max(1.1, 1.1) = 1.1; 4th masked
    close(loss, (-1.2 - 0.5 + 1.1) / 3)
    close(clipfrac, 1 / 3)
    close(ppo_kl, -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)


def test_policy_loss_asymmetric_clip():
    ratio = torch.tensor([[1.25]])
    loss, clipfrac, _ = algos.policy_loss(torch.zeros(1, 1), ratio.log(), torch.ones(1, 1), torch.ones(1, 1),
                                          0.2, 0.28)
    close(loss, -1.25)  # inside the wider upper bound: not clipped
    close(clipfrac, 0.0)


def test_policy_loss_dual_clip_bounds_negative_advantages():
    ratio = torch.tensor([[5.0, 5.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    args = (torch.zeros(1, 2), ratio.log(), adv, torch.ones(1, 2), 0.2, 0.2)
    plain, _, _ = algos.policy_loss(*args)
    dual, _, _ = algos.policy_loss(*args, clip_ratio_c=3.0)
    close(plain, (5.0 - 1.2) / 2)  # A<0: max(5, 1.2) = 5;  A>0: max(-5, -1.2) = -1.2
    close(dual, (3.0 - 1.2) / 2)  # A<0 capped at -A*c = 3; A>0 untouched
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.policy_loss(*args, clip_ratio_c=1.0)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 7.0]])
    old = torch.tensor([[0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = algos.value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: clipped value 0.7, max((1-2)^2, (0.7-2)^2) = 1.69 (clipped active); token 1: 1.0
    close(loss, 0.5 * (1.69 + 1.0) / 2)
    close(clipfrac, 0.5)


def test_token_logprobs_and_entropy_by_hand():
    p = torch.tensor([0.5, 0.25, 0.25])
    logits = torch.stack([p.log() + 3.0, torch.zeros(3)])[None]  # a constant shift leaves the distribution alone
    labels = torch.tensor([[0, 2]])
    lp, ent = algos.token_logprobs_and_entropy(logits, labels, with_entropy=True)
    close(lp, [[math.log(0.5), math.log(1 / 3)]])
    close(ent, [[1.5 * math.log(2), math.log(3)]])
    lp16, ent16 = algos.token_logprobs_and_entropy(logits.bfloat16(), labels, with_entropy=True)
    assert lp16.dtype == ent16.dtype == torch.float32 and lp16.shape == labels.shape
    close(lp16, torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, labels[..., None])[..., 0])
    # temperature 2 flattens [0.5, 0.25, 0.25] to probabilities proportional to its square roots
    q = p.sqrt() / p.sqrt().sum()
    lp2, _ = algos.token_logprobs_and_entropy(logits[:, :1], labels[:, :1], temperature=2.0)
    close(lp2, [[q[0].log()]])
    assert algos.token_logprobs_and_entropy(logits, labels)[1] is None
    # one sequence as [T, V]
    close(algos.token_logprobs_and_entropy(logits[0], labels[0], with_entropy=True)[1], ent[0])
    with pytest.raises(ValueError, match=r"logits \(1, 2, 3\) do not match labels \(1, 3\)"):
        algos.token_logprobs_and_entropy(logits, torch.zeros(1, 3, dtype=torch.long))
    lp0, ent0 = algos.token_logprobs_and_entropy(logits[:, :0], labels[:, :0], with_entropy=True)
    assert lp0.shape == ent0.shape == (1, 0)


def test_entropy_without_gradient_leaves_the_log_prob_gradient_alone():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 5, 9, generator=g)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    grads = []
    for with_entropy in (False, True):
        logits = base.clone().requires_grad_(True)
        logp, ent = algos.token_logprobs_and_entropy(logits, labels, with_entropy=with_entropy, entropy_grad=False,
                                                     chunk_tokens=2)
        assert ent is None or not ent.requires_grad
        logp.sum().backward()
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1])


def _reference_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    z = logits.float() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_whole_computation_values_and_gradients(dtype):
    """Chunks of 7 positions (not dividing 3 × 11) give the same values and, through the checkpoint's
    recomputation, the same gradients as one unchunked float32 computation."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 11, 50, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 50, (3, 11), generator=g)
    weights = torch.randn(3, 11, generator=g)
    grads = []
    for fn in ("chunked", "reference"):
        logits = base.clone().requires_grad_(True)
        if fn == "chunked":
            logp, ent = algos.token_logprobs_and_entropy(logits, labels, 0.7, with_entropy=True, chunk_tokens=7)
        else:
            logp, ent = _reference_stats(logits, labels, 0.7)
        ((logp * weights).sum() + 0.1 * ent.sum()).backward()
        grads.append((logp.detach(), ent.detach(), logits.grad.float()))
    (lp, en, gr), (lp_ref, en_ref, gr_ref) = grads
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(en, en_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gr, gr_ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


def test_chunked_logprobs_keep_no_float32_copy_of_the_logits_for_backward():
    """What autograd holds for backward, outside the checkpointed chunks and beyond the logits themselves: nothing
    as large as the logits in float32 (the whole computation keeps several such copies)."""
    logits = torch.randn(4, 64, 5000).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 5000, (4, 64))
    fp32_bytes = logits.numel() * 4

    def saved_bytes(fn) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():  # the logits (and views
                # of them) exist anyway
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = fn()
        ((logp + ent).sum()).backward()
        return total

    # the model's response positions are a slice along the sequence: taken as views, not copied
    chunked = saved_bytes(lambda: algos.token_logprobs_and_entropy(logits[:, :-1], labels[:, :-1],
                                                                   with_entropy=True, chunk_tokens=32))
    whole = saved_bytes(lambda: _reference_stats(logits, labels, 1.0))
    assert whole >= 2 * fp32_bytes
    assert chunked < 0.05 * fp32_bytes, (chunked, fp32_bytes)


def test_apply_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    lp = torch.full((2, 3), -1.0)
    ref = torch.tensor([[-1.5, -1.0, -2.0], [-1.0, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, kl_mean = algos.apply_kl_in_reward(scores, lp, ref, mask, kl_coef=0.1, kind="k1")
    # k1 = lp - ref = [[.5, 0, 1], [0, .5, (masked)]]
    close(rewards, [[-0.05, 0.0, 0.9], [0.0, 1.95, 0.0]])
    close(kl_mean, (1.5 / 3 + 0.5 / 2) / 2)


def test_outcome_to_token_scores_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = algos.outcome_to_token_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
