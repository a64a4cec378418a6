"""perf/mfu/actor's numerator: `training_flops` against the FLOPs torch counts in a real model's forward and
backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from zbench.engine.records import attention_width, multiplied_parameters, training_flops


def _counted(model: torch.nn.Module, length: int) -> int:
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
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
    lengths = [5, 23, 64]
    counted = sum(_counted(model, t) for t in lengths)
    # an untied input embedding is looked up, not multiplied: its parameters cost nothing
    params = multiplied_parameters(sum(p.numel() for p in model.parameters()), config)
    assert params == sum(p.numel() for p in model.parameters()) - (0 if tied else 512 * 64)
    expected = training_flops(params, config.num_hidden_layers, attention_width(config), lengths)
    # what torch does not count: the norms' few weights (scaled, not multiplied into a sum)
    assert counted == pytest.approx(expected, rel=0.01)
    # the hidden size in the attention's place (the formula before) misses 8 % here, far outside that tolerance
    assert training_flops(params, config.num_hidden_layers, config.hidden_size, lengths) < 0.95 * counted


def test_padding_and_lengths_count_as_the_tokens_attended():
    # a 10-token and a 30-token sequence: their squares, not the padded width's (30) twice
    assert training_flops(0, 1, 1, [10, 30]) == 12 * (10 * 10 + 30 * 30)
    assert training_flops(7, 2, 3, []) == 0
