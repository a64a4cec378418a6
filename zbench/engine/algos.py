"""PPO / GRPO mathematics as pure tensor functions.

Every function takes ``[B, T]`` token tensors over right-padded responses together with a ``response_mask``
(1 on generated tokens, 0 on padding) and returns tensors; nothing here knows about workers, devices or
DeepSpeed. Conventions follow verl so that metrics read the same: token-mean loss aggregation, advantages
whitened over the valid tokens of the batch, verl's KL estimator names.
"""

from __future__ import annotations

import numpy as np
import torch

_KL_KINDS = {"k1": "kl", "kl": "kl", "k2": "mse", "mse": "mse", "k3": "low_var_kl", "low_var_kl": "low_var_kl",
             "abs": "abs"}


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero (0 where the mask is empty). With ``denom``, the
    masked sum over ``denom`` instead of over the mask's count: this micro-batch's share of a mean taken over more
    tokens than it holds (`token_share`)."""
    # where() rather than x * mask so that inf/nan sitting in padding cannot leak into the sum.
    masked = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    if denom is not None:
        if dim is not None:
            raise ValueError("masked_mean takes a denom for the whole tensor's mean, not with dim")
        return masked.sum() / denom
    if dim is None:
        return masked.sum() / mask.sum().clamp_min(1e-8)
    return masked.sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked positions.

    The variance is Bessel-corrected (as in verl) when at least two positions are valid. With
    ``shift_mean=False`` the mean is added back, so only the scale changes.
    """
    mean = masked_mean(x, mask)
    centered = x - mean
    n = mask.sum()
    var = masked_mean(centered**2, mask)
    if n >= 2:
        var = var * n / (n - 1)
    whitened = centered * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each response.

    Scans positions from last to first; at a padded position the running advantage and the bootstrap value
    are carried through unchanged, so padding never bootstraps from garbage values and the value after the
    last valid token is 0. Returns ``(advantages, returns)`` with ``returns = raw advantages + values``;
    advantages are whitened over the batch when ``whiten`` (verl's default) and are 0 on padding.

    The scan is sequential in the position, so its cost is one step per token of the longest response; it runs in
    numpy on the host, where an elementwise operation on a batch-sized row costs about a microsecond against
    torch's several (a 64 x 512 batch: about 3 ms instead of 20-35), with the same float operations in the same
    order, so the result is the same to the bit.
    """
    mask = response_mask.to(values.dtype)
    advantages = _gae_scan(token_rewards.to(values.dtype), values.detach(), mask, gamma, lam)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns * mask


def _gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
              lam: float) -> torch.Tensor:
    """Raw GAE advantages of `compute_gae`, position by position from the last; 0-padding carries through."""
    dtype = values.dtype if values.dtype in (torch.float32, torch.float64) else torch.float32
    r, v, m = (np.ascontiguousarray(x.to("cpu", dtype).numpy().T) for x in (rewards, values, mask))
    carry = 1 - m
    out = np.empty_like(v)
    next_value = np.zeros(v.shape[1], dtype=v.dtype)
    last_gae = np.zeros_like(next_value)
    for t in range(v.shape[0] - 1, -1, -1):
        delta = r[t] + gamma * next_value - v[t]
        gae = delta + gamma * lam * last_gae
        next_value = v[t] * m[t] + next_value * carry[t]
        last_gae = gae * m[t] + last_gae * carry[t]
        out[t] = last_gae
    return torch.from_numpy(out.T.copy()).to(values.device, values.dtype)


def _group_sums(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group index, and per group the sample count and the sum of scores."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores))
    return inverse, counts, torch.zeros_like(counts).index_add_(0, inverse, scores)


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages: each outcome score minus its group's mean (divided by the group's std).

    ``scores`` [B] holds one outcome reward per sample and ``group_ids`` [B] the prompt each sample came from.
    The std is the unbiased one; a group of one sample gets mean 0 and std 1 (as in verl), i.e. its raw score.
    The per-sample advantage is broadcast over its response tokens; returns equal advantages.
    """
    scores = scores.to(torch.float32)
    inverse, counts, sums = _group_sums(scores, group_ids)
    mean = sums / counts
    sq_dev = torch.zeros_like(counts).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (counts - 1).clamp_min(1))
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    adv = scores - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return advantages, advantages.clone()


def compute_rloo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al., 2024): each outcome score minus the mean of the *other* samples of
    its group, i.e. ``n/(n-1) * (score - group mean)``; a group of one sample keeps its raw score (no baseline).
    Broadcast over the response tokens; returns equal advantages."""
    scores = scores.to(torch.float32)
    inverse, counts, sums = _group_sums(scores, group_ids)
    others = (counts[inverse] - 1).clamp_min(1)
    baseline = torch.where(counts[inverse] > 1, (sums[inverse] - scores) / others, torch.zeros_like(scores))
    advantages = (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages.clone()


def compute_advantages(
    estimator: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by the estimator named in ``algo.adv_estimator``: one branch per estimator.

    ``gae`` needs the critic's ``values``; the group estimators (``grpo``, ``rloo``) need ``group_ids`` and take each
    sample's summed token reward as its outcome."""
    if estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs the critic's values")
        return compute_gae(token_rewards, values, response_mask, gamma, lam)
    if group_ids is None:
        raise ValueError(f"adv_estimator {estimator!r} needs the group (prompt) of every sample")
    if estimator == "grpo":
        return compute_grpo_advantages(token_rewards.sum(-1), group_ids, response_mask, norm_by_std)
    if estimator == "rloo":
        return compute_rloo_advantages(token_rewards.sum(-1), group_ids, response_mask)
    raise ValueError(f"unknown adv_estimator {estimator!r}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference from sampled-token log-probs.

    ``kind``: ``k1``/``kl`` (log-ratio), ``k2``/``mse`` (half squared log-ratio), ``k3``/``low_var_kl``
    (Schulman's unbiased, low-variance ``r - log r - 1`` with ``r = ref/policy``, clamped to [-10, 10]), ``abs``.
    """
    name = _KL_KINDS.get(kind)
    if name is None:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(_KL_KINDS)}")
    log_ratio = logprob - ref_logprob
    if name == "kl":
        return log_ratio
    if name == "abs":
        return log_ratio.abs()
    if name == "mse":
        return 0.5 * log_ratio.square()
    # Clamp before exp: a log-ratio of 20+ would overflow and the estimate is clamped afterwards anyway.
    ref_over_pi = (-log_ratio).clamp(-20.0, 20.0)
    return (torch.exp(ref_over_pi) - ref_over_pi - 1).clamp(-10.0, 10.0)


def policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss, token-mean over the mask (or its share of a larger mean, ``denom`` as
    `masked_mean` takes it); returns ``(pg_loss, pg_clipfrac, ppo_kl)``.

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]``. With ``clip_ratio_c`` (> 1) the
    dual-clip bound caps the loss of negative-advantage tokens at ``-A * clip_ratio_c``. ``pg_clipfrac`` is the
    fraction of tokens where the clipped term is active; ``ppo_kl`` the mean of ``old - new`` log-probs (k1).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask, denom=denom)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), response_mask, denom=denom)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        losses = torch.where(advantages < 0, torch.minimum(losses, dual_bound), losses)
    return masked_mean(losses, response_mask, denom=denom), pg_clipfrac, ppo_kl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((v - R)^2, (v_clipped - R)^2)``, token-mean (or its share, ``denom`` as
    `masked_mean` takes it); returns ``(loss, clipfrac)``.

    ``v_clipped`` keeps the new value within ``cliprange_value`` of the value at rollout time.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    err_unclipped = (values - returns).square()
    err_clipped = (clipped - returns).square()
    vf_loss = 0.5 * masked_mean(torch.maximum(err_unclipped, err_clipped), response_mask, denom=denom)
    vf_clipfrac = masked_mean((err_clipped > err_unclipped).to(values.dtype), response_mask, denom=denom)
    return vf_loss, vf_clipfrac


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract ``kl_coef * KL`` from the token scores; returns ``(token_level_rewards, kl_mean)``.

    ``kl_mean`` is the per-sequence token-mean KL averaged over the batch (a 0-dim tensor), as verl logs it.
    """
    kld = kl_penalty(logprob, ref_logprob, kind) * response_mask
    rewards = token_level_scores - kl_coef * kld
    kl_mean = masked_mean(kld, response_mask, dim=-1).mean()
    return rewards, kl_mean


def outcome_to_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's outcome score on its last valid response token ([B] -> [B, T]).

    A response with no valid token receives nothing.
    """
    length = response_mask.shape[-1]
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
    last = torch.where(response_mask != 0, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(-1)
    out[rows, last[rows]] = scores[rows].to(torch.float32)
    return out


def _token_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool,
                 entropy_grad: bool) -> tuple[torch.Tensor, ...]:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return (logp,)
    # last, and without a graph when no gradient is wanted: a checkpoint's recomputation stops once it has what
    # backward needs, so then it skips the entropy
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, ent


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                               with_entropy: bool = False, entropy_grad: bool = True, chunk_tokens: int = 1024,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``labels`` under ``logits / temperature`` and, if asked, the entropy (with gradients
    only if ``entropy_grad``), both float32 ([..., T, V] -> [..., T]), computed at most ``chunk_tokens`` positions
    of one sequence at a time.

    The float32 copy of the logits, its softmax and its log-sum-exp exist for one chunk at a time. With gradients,
    each chunk is checkpointed: backward recomputes it from the (half-precision) logits instead of keeping the
    float32 intermediates of the whole micro-batch, which over a 152k vocabulary are several GB. Chunks are views
    within one sequence, so logits sliced along the sequence (the model's response positions) are not copied. The
    values equal an unchunked computation (every quantity is per position).
    """
    from torch.utils.checkpoint import checkpoint

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} (expected "
                         f"labels.shape + (vocab,))")
    if labels.numel() == 0:
        empty = logits.new_zeros(labels.shape, dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    seqs = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits[None]
    seq_labels = labels.reshape(-1, labels.shape[-1]) if labels.dim() > 1 else labels[None]
    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    chunks = []  # (logp,) or (logp, entropy) per chunk
    for seq, lab in zip(seqs, seq_labels, strict=True):
        for start in range(0, seq.shape[0], chunk_tokens):
            args = (seq[start : start + chunk_tokens], lab[start : start + chunk_tokens], temperature, with_entropy,
                    entropy_grad)
            if keep_graph:  # nothing in a chunk is random: no RNG state to keep for its recomputation
                chunks.append(checkpoint(_token_stats, *args, use_reentrant=False, preserve_rng_state=False))
            else:
                chunks.append(_token_stats(*args))
    logp, *ent = (torch.cat(parts).reshape(labels.shape) for parts in zip(*chunks, strict=True))
    return logp, ent[0] if ent else None
