"""The LM head and the token statistics an RL update needs, chunk by chunk, never holding a micro-batch's logits.

A policy's loss reads, per response token, the log-probability of the sampled token and (for the entropy bonus and
its statistic) the entropy of the next-token distribution. The plain path computes `lm_head(hidden)` for the whole
micro-batch (tokens x 152k bf16 logits for Qwen3, 5 GB at 32 sequences of 512 tokens, and as much again for their
gradient) and then reduces it. `head_logprobs` instead projects `chunk_tokens` positions at a time, reduces each
chunk to (log-prob, entropy) in float32 and drops it; backward projects each chunk again and turns the two
statistics' gradients into the hidden states' and the head weight's gradients directly:

    z = h Wᵀ / T,  p = softmax(z),  log p(y) = z_y − lse(z),  H = lse(z) − Σ p z
    ∂ log p(y) / ∂z = onehot(y) − p,    ∂H / ∂z = −p ⊙ (z − lse(z) + H)

The logits are rounded to the weight's dtype before the float32 reduction, as the plain path's bf16 `Linear` output
is, so forward values match it; the weight's gradient is summed over chunks in float32.

`head_loss` goes one matmul further where the loss is a sum of per-token terms of these statistics (the policy loss,
its entropy bonus and KL penalty are): given the loss of any chunk of tokens (`TokenLoss`), it takes each chunk's
loss and its gradient while the chunk's logits are still there, so backward has no logits to project again; it only
scales the gradients formed in forward by the loss's own upstream gradient (DeepSpeed's accumulation factor).

Within `head_computes_stats`, a Hugging Face causal LM (or a DeepSpeed engine around one) returns these statistics
from its head in place of logits (`fusable_head` says which heads qualify): the head module is called as usual, so ZeRO-3 gathers its (possibly tied) weight for
forward and again for backward as it does for any `Linear`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEFAULT_CHUNK_TOKENS = 4096  # one chunk of Qwen3's bf16 logits: 4096 x 152k x 2 B = 1.2 GB

# (log-probs [n] with gradient, entropies [n] (with gradient when the entropy is in the loss; None when none was
# asked), the rows of the flattened [B, R] tokens they belong to) -> those tokens' loss, a 0-dim tensor. The loss of
# all tokens must be the sum of the chunks' losses, each chunk's depending on its own tokens only.
TokenLoss = Callable[[torch.Tensor, "torch.Tensor | None", slice], torch.Tensor]

# Attributes of a model config that change what the head returns beyond `hidden @ weight.T`: a model that sets any
# of them takes the plain path.
_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


def _chunk_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, log p(labels), entropy or an empty tensor) of one chunk's logits [rows, V], in float32."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1) if with_entropy else lse.new_empty(0)
    return lse, logp, ent


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                grad_logp: torch.Tensor, grad_ent: torch.Tensor, temperature: float,
                entropy_grad: bool) -> torch.Tensor:
    """The gradient of one chunk's logits [rows, V] (in their dtype) for the statistics' gradients [rows]:
    dL/dz = gl (onehot - p) - ge p (log p + H), divided by the temperature."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    log_p = z - lse[:, None]
    coef = grad_logp[:, None]
    if entropy_grad:
        coef = coef + grad_ent[:, None] * (log_p + ent[:, None])
    vocab = torch.arange(z.shape[-1], device=z.device)
    g = torch.where(vocab[None] == labels[:, None], grad_logp[:, None], 0.0) - torch.exp(log_p) * coef
    if temperature != 1.0:
        g = g / temperature
    return g.to(logits.dtype)


_compiled: dict[str, Any] = {}


def _kernels(device: torch.device) -> tuple[Any, Any]:
    """The two per-chunk reductions: on CUDA compiled (fused kernels that read the chunk's bf16 logits once or twice
    instead of a dozen float32 passes), eager elsewhere."""
    if device.type != "cuda":
        return _chunk_stats, _chunk_grad
    if not _compiled:
        _compiled["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _compiled["grad"] = torch.compile(_chunk_grad, dynamic=True)
    return _compiled["stats"], _compiled["grad"]


class _HeadStats(torch.autograd.Function):
    """(log p(labels), entropy) of softmax(hidden @ weight.T / temperature), chunk by chunk: one chunk's logits (and,
    in backward, their gradient) live at a time; the matmuls are the head's own, in its dtype."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                with_entropy: bool, entropy_grad: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        stats, _ = _kernels(hidden.device)
        parts = [stats(hidden[s : s + chunk] @ weight.t(), labels[s : s + chunk], temperature, with_entropy)
                 for s in range(0, hidden.shape[0], chunk)]
        lse, logp, ent = (torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None,
                 grad_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        _, grad_of_logits = _kernels(hidden.device)
        entropy_grad = ctx.entropy_grad and grad_ent is not None
        grad_logp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        grad_ent = grad_ent if entropy_grad else lse
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            g = grad_of_logits(hidden[rows] @ weight.t(), labels[rows], lse[rows],
                               ent[rows] if entropy_grad else lse[rows], grad_logp[rows], grad_ent[rows],
                               ctx.temperature, entropy_grad)
            if grad_hidden is not None:
                grad_hidden[rows] = g @ weight
            if grad_weight is not None:
                grad_weight.add_(g.t() @ hidden[rows])
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, \
            None


class _HeadLoss(torch.autograd.Function):
    """(log p(labels), entropy, loss) where loss = Σ over chunks of `token_loss`: each chunk's logits are projected
    once, and reduced to its statistics and then, with the gradient of its loss with respect to them, to its share of
    the hidden states' and the head weight's gradients. The statistics leave without gradient; the loss carries it."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                with_entropy: bool, entropy_grad: bool, chunk: int, token_loss: TokenLoss
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stats, grad_of_logits = _kernels(hidden.device)
        entropy_grad = with_entropy and entropy_grad
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        logps, ents, losses = [], [], []
        for s in range(0, hidden.shape[0], chunk):
            rows = slice(s, s + chunk)
            logits = hidden[rows] @ weight.t()
            lse, logp, ent = stats(logits, labels[rows], temperature, with_entropy)
            with torch.enable_grad():  # the loss's gradient with respect to this chunk's statistics
                lp = logp.detach().requires_grad_()
                en = ent.detach().requires_grad_(entropy_grad) if with_entropy else None
                loss = token_loss(lp, en, rows)
                wrt = [lp, en] if entropy_grad and en is not None else [lp]
                grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else ()
            g_logp, g_ent = (*grads, None, None)[:2]  # None: no gradient asked, or the loss does not depend on it
            g_logp = g_logp if g_logp is not None else torch.zeros_like(lse)
            g_ent = g_ent if g_ent is not None else torch.zeros_like(lse)
            if grad_hidden is not None or grad_weight is not None:
                g = grad_of_logits(logits, labels[rows], lse, ent if entropy_grad else lse, g_logp, g_ent,
                                   temperature, entropy_grad)
                if grad_hidden is not None:
                    grad_hidden[rows] = g @ weight
                if grad_weight is not None:
                    grad_weight.add_(g.t() @ hidden[rows])
            logps.append(logp)
            ents.append(ent)
            losses.append(loss.detach())
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        logp, ent = torch.cat(logps), torch.cat(ents)
        ctx.mark_non_differentiable(logp, ent)
        return logp, ent, torch.stack(losses).sum() if losses else hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, _grad_logp: torch.Tensor | None, _grad_ent: torch.Tensor | None,
                 grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place (backward runs once): in bf16 each gradient is rounded when formed and again when scaled,
        # where the plain path rounds once; unbiased, and exact at a scale of 1 (no accumulation)
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.float()
        return (None if grad_hidden is None else grad_hidden.mul_(scale),
                None if grad_weight is None else grad_weight.mul_(scale), None, None, None, None, None, None)


def _check(hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> None:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)} (expected "
                         f"labels.shape + (hidden,))")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_loss: TokenLoss,
              temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """As `head_logprobs`, and the loss `token_loss` gives over all tokens (chunk by chunk, on the flattened
    `labels`), whose gradient is formed during this call: (log-probs, entropies or None, loss). Only the loss
    carries a gradient; backward costs no matmul."""
    _check(hidden, labels, chunk_tokens)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent, loss = _HeadLoss.apply(flat, weight, labels.reshape(-1), float(temperature), with_entropy,
                                      entropy_grad, chunk_tokens, token_loss)
    return logp.reshape(labels.shape), ent.reshape(labels.shape) if with_entropy else None, loss


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of `labels` ([..., T]) under softmax(hidden @ weight.T / temperature) and, if asked, the
    entropy (with gradients only if `entropy_grad`), both float32 [..., T], from `hidden` [..., T, H] without ever
    holding more than `chunk_tokens` rows of logits."""
    _check(hidden, labels, chunk_tokens)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _HeadStats.apply(flat, weight, labels.reshape(-1), float(temperature), with_entropy, entropy_grad,
                                 chunk_tokens)
    return logp.reshape(labels.shape), ent.reshape(labels.shape) if with_entropy else None


def fusable_head(model: Any) -> torch.nn.Module | None:
    """The plain `Linear` (no bias) head of a Hugging Face causal LM, or a DeepSpeed engine around one, whose logits
    are exactly `hidden @ weight.T`; None where the head is anything else (a bias, a scale, a soft cap)."""
    module = getattr(model, "module", model)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    config = getattr(module, "config", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1.0) for name in _HEAD_MODIFIERS):
        return None
    return head


@contextlib.contextmanager
def head_computes_stats(head: torch.nn.Module, labels: torch.Tensor, temperature: float, with_entropy: bool,
                        entropy_grad: bool, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                        token_loss: TokenLoss | None = None) -> Iterator[None]:
    """Within the block, `head` called on hidden states [B, R + 1, H] (a causal LM's last R + 1 positions) returns
    the statistics of `labels` [B, R] at the first R positions, stacked [B, R, 2] (log-prob, entropy; entropy 0
    without `with_entropy`), in place of logits. With `token_loss` (under autograd), `head_loss`'s: [B, R, 3], the
    third channel the loss at every position (any one of them, e.g. `[0, 0, 2]`, is the loss with its gradient)."""

    def stats_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] != labels.shape[1] + 1:
            raise ValueError(f"the head saw {hidden.shape[1]} positions, expected {labels.shape[1] + 1} "
                             "(the responses and the position before them)")
        if token_loss is not None:
            if not torch.is_grad_enabled():
                raise RuntimeError("the head takes the loss only under autograd (it forms the loss's gradient)")
            logp, ent, loss = head_loss(hidden[:, :-1], head.weight, labels, token_loss, temperature, with_entropy,
                                        entropy_grad, chunk_tokens)
            extra = [loss.expand(logp.shape)]
        else:
            logp, ent = head_logprobs(hidden[:, :-1], head.weight, labels, temperature, with_entropy, entropy_grad,
                                      chunk_tokens)
            extra = []
        return torch.stack((logp, ent if ent is not None else torch.zeros_like(logp), *extra), dim=-1)

    head.forward = stats_forward  # an instance attribute: hooks (ZeRO-3's gathers) still run around it
    try:
        yield
    finally:
        del head.forward
