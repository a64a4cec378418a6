"""Micro-batches for the training and scoring passes: all-padding prompt columns are trimmed per micro-batch
without changing a single log-prob, and the gradient-free passes may use a larger micro-batch."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from zbench.config import ConfigError, from_dict
from zbench.engine.models import resolve_model
from zbench.engine.trainer import left_pad
from zbench.engine.workers import PolicyWorker, forward_batches, micro_batches, trim_left_padding


def _batch() -> dict[str, torch.Tensor]:
    """Six sequences whose prompts are 3..17 tokens, left-padded to the longest, with 5-token responses."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (17, 4, 3, 9, 5, 16)]
    p_ids, p_mask = left_pad(prompts, 0)
    responses = torch.randint(3, 90, (6, 5), generator=g)
    r_mask = torch.ones_like(responses)
    r_mask[2, 3:] = 0  # an early EOS: trailing padding inside the response
    attn = torch.cat([p_mask, r_mask], 1)
    return {"input_ids": torch.cat([p_ids, responses], 1), "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp_min(0), "responses": responses, "response_mask": r_mask}


def test_trim_drops_only_columns_that_are_padding_in_every_row():
    batch = _batch()
    first, second = micro_batches(batch, 3)
    a, b = trim_left_padding(first), trim_left_padding(second)
    assert a["input_ids"].shape[1] == batch["input_ids"].shape[1]  # holds the 17-token prompt: nothing to drop
    assert b["input_ids"].shape[1] == 16 + 5  # its longest prompt is 16
    for mb, trimmed in ((first, a), (second, b)):
        cut = mb["input_ids"].shape[1] - trimmed["input_ids"].shape[1]
        assert not mb["attention_mask"][:, :cut].any()
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert torch.equal(trimmed[key], mb[key][:, cut:])
        assert trimmed["responses"] is mb["responses"] and trimmed["response_mask"] is mb["response_mask"]


@torch.no_grad()
def test_trimmed_forward_gives_the_same_log_probs():
    """The actor's own log-prob pass, on whole and on trimmed micro-batches of a real (tiny) model."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    worker = SimpleNamespace(cfg=from_dict({}))
    batch = _batch()
    whole = torch.cat([PolicyWorker._logprobs(worker, model, mb)[0] for mb in micro_batches(batch, 3)])
    trimmed = torch.cat([PolicyWorker._logprobs(worker, model, mb)[0] for mb in forward_batches(batch, 3)])
    assert trimmed.shape == whole.shape == batch["responses"].shape
    assert torch.allclose(trimmed, whole, atol=1e-5)
    assert forward_batches(batch, 3)[1]["input_ids"].shape[1] < batch["input_ids"].shape[1]


def test_forward_micro_batch_size_is_validated():
    assert from_dict({"actor": {"forward_micro_batch_size_per_gpu": 16}}).actor.forward_micro_batch_size_per_gpu == 16
    with pytest.raises(ConfigError, match="forward_micro_batch_size_per_gpu"):
        from_dict({"critic": {"forward_micro_batch_size_per_gpu": -1}})
