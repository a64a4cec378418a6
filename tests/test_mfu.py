"""perf/mfu/actor's numerator: `training_flops` against the FLOPs torch counts in a real model's forward and
backward, as the actor's update runs it (logits only for the response positions)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from zbench.engine.records import attention_width, training_flops
from zbench.engine.trainer import Trainer


def _counted(model: torch.nn.Module, length: int, kept: int) -> int:
    """FLOPs of a forward and backward of one `length`-token sequence whose last `kept` positions' logits the loss
    reads (`logits_to_keep`, as the actor's update asks for the responses')."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids, logits_to_keep=kept).logits
        logits.float().logsumexp(-1).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False])
def test_training_flops_are_what_a_forward_and_backward_multiply(tied):
    # heads x head dim (4 x 32) twice the hidden size, as in Qwen3-0.6B (16 x 128 over 1024)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=tied,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    assert attention_width(model.config) == 128 != model.config.hidden_size
    lengths, kept = [5, 23, 64], [2, 11, 40]  # prompt + response tokens; the responses' logits
    counted = sum(_counted(model, t, k) for t, k in zip(lengths, kept, strict=True))
    params = sum(p.numel() for p in model.parameters())
    expected = training_flops(params, config, lengths, sum(kept))
    # what torch does not count: the norms' few weights (scaled, not multiplied into a sum)
    assert counted == pytest.approx(expected, rel=0.01)
    # each part of the count matters here: the head on every token would count 6 % too many, the hidden size in the
    # attention's width 8 % too few, an untied embedding counted as multiplied 14 % too many
    assert training_flops(params, config, lengths, sum(lengths)) > 1.05 * counted
    narrow = copy.deepcopy(config)
    narrow.head_dim = config.hidden_size // config.num_attention_heads
    assert training_flops(params, narrow, lengths, sum(kept)) < 0.95 * counted
    if not tied:
        assert expected + 6 * 512 * 64 * sum(lengths) > 1.05 * counted


def test_padding_and_lengths_count_as_the_tokens_attended():
    config = SimpleNamespace(vocab_size=2, hidden_size=1, num_attention_heads=1, head_dim=1, num_hidden_layers=1,
                             tie_word_embeddings=True)
    # no decoder parameters beside the head (2 x 1): the attention over a 10- and a 30-token sequence counts their
    # squares, not the padded width's (30) twice; the head, its tokens
    assert training_flops(2, config, [10, 30], 0) == 12 * (10 * 10 + 30 * 30)
    assert training_flops(2, config, [10, 30], 7) == 12 * (10 * 10 + 30 * 30) + 6 * 2 * 7
    assert training_flops(2, config, [], 0) == 0


def test_a_steps_actor_mfu_counts_its_rows_lengths_responses_and_epochs():
    """`Trainer._perf_metrics` on a step's batch: each row's own length (prompt padding left out), its responses'
    tokens for the head, the update's epochs, over the update's time on every rank's peak."""
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    prompt = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    response = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    batch = {"attention_mask": torch.cat([prompt, response], dim=1), "response_mask": response}
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(world_size=2, critic_update="serial"),
                            actor=SimpleNamespace(ppo_epochs=2)),
        timing={"timing_s/step": 4.0, "timing_s/update_actor": 1.5}, critic=None,
        info={"gpu_name": "NVIDIA H100 80GB HBM3", "params": 10**6}, model_config=config)
    out = Trainer._perf_metrics(trainer, batch)
    assert out["perf/total_num_tokens"] == 5 + 9
    flops = 2 * training_flops(10**6, config, [5, 9], 3 + 5)
    assert out["perf/mfu/actor"] == pytest.approx(flops / (1.5 * 2 * 989e12))
