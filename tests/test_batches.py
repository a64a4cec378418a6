"""Micro-batches for the training and scoring passes: all-padding prompt columns are trimmed per micro-batch
without changing a single log-prob; the maskless layout (padding moved behind the tokens, causal attention only)
gives the same log-probs, values and gradients as the masked one; the gradient-free passes may use a larger
micro-batch."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from zbench.config import ConfigError, from_dict
from zbench.engine.batches import (
    forward_batches,
    left_pad,
    micro_batches,
    sequence_batch,
    shift_padding_right,
    trim_left_padding,
)
from zbench.engine.workers import PolicyWorker, model_outputs, response_decoder
from zbench.models import resolve_model


def _batch() -> dict[str, torch.Tensor]:
    """Six sequences whose prompts are 3..17 tokens, left-padded to the longest, with 5-token responses."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (17, 4, 3, 9, 5, 16)]
    p_ids, p_mask = left_pad(prompts, 0)
    responses = torch.randint(3, 90, (6, 5), generator=g)
    r_mask = torch.ones_like(responses)
    r_mask[2, 3:] = 0  # an early EOS: trailing padding inside the response
    r_mask[5, 2:] = 0  # the longest prompt of rows 3-5, with a short response: their layout is narrower
    return sequence_batch(p_ids, p_mask, responses, r_mask)


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


def test_shift_padding_right_moves_each_rows_padding_behind_its_tokens():
    batch = _batch()
    prompt_width = batch["input_ids"].shape[1] - 5
    for mb in micro_batches(batch, 3):
        out = shift_padding_right(mb)
        assert set(out) == {"input_ids", "hidden_index", "responses", "response_mask"}
        lengths = mb["attention_mask"][:, :prompt_width].sum(1)
        rows = lengths + mb["response_mask"].sum(1)  # prompt and response up to its EOS
        width = out["input_ids"].shape[1]
        assert width == int(rows.max())  # the micro-batch's longest row, no more
        for row in range(3):
            n, r = int(lengths[row]), int(rows[row])
            tokens = mb["input_ids"][row, prompt_width - n :][: width]  # the prompt, then the response
            assert torch.equal(out["input_ids"][row, : min(n + 5, width)], tokens)
            assert not out["input_ids"][row, n + 5 :].ne(0).any()  # the rest is the row's own padding (id 0)
            # the last prompt token, then each response token: the columns that score the response; after the
            # row's end they point inside the micro-batch (masked out of everything)
            index = out["hidden_index"][row].tolist()
            assert index[: r - n + 1] == list(range(n - 1, r))
            assert max(index) <= width - 1
    # rows 3-5: row 5's 16-token prompt and 2-token response, not 16 + the response columns' 5
    assert shift_padding_right(micro_batches(batch, 3)[1])["input_ids"].shape[1] == 16 + 2


def _tiny_pair(head: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical tiny float32 models (the actor's LM head, or the critic's value head)."""
    path = resolve_model("tiny")
    if head == "lm":
        build = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    else:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        build = lambda: AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32,  # noqa: E731
                                                                        config=config)
    torch.manual_seed(0)
    masked = build()
    maskless = build()
    maskless.load_state_dict(masked.state_dict())
    return masked, maskless


def test_maskless_layout_gives_the_masked_log_probs_and_gradients():
    """The actor's own log-prob pass on both layouts of the same micro-batches; a loss over the response tokens
    gives the same gradient on every parameter (padding contributes nothing in either layout)."""
    masked, maskless = _tiny_pair("lm")
    worker = SimpleNamespace(cfg=from_dict({}))
    batch = _batch()
    logps = []
    for model, flag in ((masked, False), (maskless, True)):
        parts = [PolicyWorker._logprobs(worker, model, mb)[0] for mb in forward_batches(batch, 3, maskless=flag)]
        logp = torch.cat(parts) * batch["response_mask"]  # after an early EOS the layouts differ, and nothing reads it
        logp.sum().backward()
        logps.append(logp)
    assert torch.allclose(logps[0], logps[1], atol=1e-5)
    assert logps[0].abs().sum() > 0
    for (name, a), b in zip(masked.named_parameters(), maskless.parameters(), strict=True):
        assert a.grad is not None, name
        # summation order differs between layouts: the tolerance scales with the gradient (the tied embedding's
        # reaches ~60, where float32 reassociation alone moves an element by ~2e-5)
        scale = float(a.grad.abs().max())
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5 + 1e-6 * scale), name


@torch.no_grad()
def test_aligned_widths_give_the_same_log_probs():
    """Widths rounded up to a multiple of 8 (as compiled layers get them), in both layouts, including a width beyond
    the batch's own (22 -> 24): the same log-probs as the unaligned masked layout."""
    model = _tiny_pair("lm")[0]
    worker = SimpleNamespace(cfg=from_dict({}))
    batch = _batch()
    assert batch["input_ids"].shape[1] == 22
    reference = torch.cat([PolicyWorker._logprobs(worker, model, mb)[0]
                           for mb in forward_batches(batch, 3)]) * batch["response_mask"]
    for maskless in (False, True):
        for size in (3, 6):
            mbs = forward_batches(batch, size, maskless=maskless, align=8)
            assert all(mb["input_ids"].shape[1] % 8 == 0 for mb in mbs)
            logp = torch.cat([PolicyWorker._logprobs(worker, model, mb)[0] for mb in mbs]) * batch["response_mask"]
            assert torch.allclose(logp, reference, atol=1e-5), (maskless, size)
    wide = forward_batches(batch, 6, align=8)[0]
    assert wide["input_ids"].shape[1] == 24 and not wide["attention_mask"][:, :2].any()  # masked columns in front


@torch.no_grad()
def test_maskless_layout_gives_the_masked_values():
    """The critic's value head reads the same positions in both layouts."""
    masked, maskless = _tiny_pair("value")
    batch = _batch()
    width = batch["responses"].shape[1]
    values = []
    for model, flag in ((masked, False), (maskless, True)):
        outs = [model_outputs(model, mb).logits[:, -width - 1 : -1, 0] for mb in forward_batches(batch, 3, flag)]
        values.append(torch.cat(outs) * batch["response_mask"])
    assert values[0].shape == batch["responses"].shape
    assert torch.allclose(values[0], values[1], atol=1e-5)
    # the hook is gone after the call: the model runs as before
    assert model_outputs(maskless, micro_batches(batch, 3)[0]).logits.shape[1] == batch["input_ids"].shape[1]


def _random_lm(model_type: str, **extra: int) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=256, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class _Bypass(torch.nn.Module):
    """A wrapper whose forward skips the decoder it names (as a head reading another module would)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def get_decoder(self) -> torch.nn.Module:
        return self.inner.get_decoder()

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.inner.get_input_embeddings()(input_ids)


@torch.no_grad()
def test_maskless_layout_reads_the_decoder_a_head_reads():
    """OPT's head runs its decoder stack, not its base model's forward: the hidden states are gathered there. A
    model without a decoder apart from its head (Llama 4's text model names a base attribute it lacks) is a config
    error naming the key, as is a forward that never passes through the decoder."""
    model = _random_lm("opt", ffn_dim=128, word_embed_proj_dim=64)
    assert type(response_decoder(model)).__name__ == "OPTDecoder"
    worker = SimpleNamespace(cfg=from_dict({}))
    batch = _batch()
    masked, maskless = (torch.cat([PolicyWorker._logprobs(worker, model, mb)[0]
                                   for mb in forward_batches(batch, 3, flag)]) * batch["response_mask"]
                        for flag in (False, True))
    assert torch.allclose(masked, maskless, atol=1e-5)
    llama4 = _random_lm("llama4_text", num_key_value_heads=2, intermediate_size=128, intermediate_size_mlp=128,
                        head_dim=16, num_local_experts=2)
    with pytest.raises(ConfigError, match=r"model\.maskless_attention"):
        response_decoder(llama4)
    mb = forward_batches(batch, 3, maskless=True)[0]
    with pytest.raises(ConfigError, match="ran OPTDecoder 0 times"):
        model_outputs(_Bypass(model), mb)


def test_forward_micro_batch_size_is_validated():
    assert from_dict({"actor": {"forward_micro_batch_size_per_gpu": 16}}).actor.forward_micro_batch_size_per_gpu == 16
    with pytest.raises(ConfigError, match="forward_micro_batch_size_per_gpu"):
        from_dict({"critic": {"forward_micro_batch_size_per_gpu": -1}})


def test_shift_padding_right_keeps_up_to_each_rows_last_response_token():
    """A micro-batch is as wide as its rows reach: to the last response token the mask holds, even were the mask to
    have a hole (no producer makes one), so no scored position is ever cut off."""
    batch = _batch()
    mb = micro_batches(batch, 3)[1]  # rows 3-5: prompts of 9, 5 and 16 tokens; row 5's response ends after 2
    mb["response_mask"] = mb["response_mask"].clone()
    mb["response_mask"][2] = torch.tensor([1, 0, 0, 1, 0])  # row 5 scores response tokens 1 and 4
    out = shift_padding_right(mb)
    assert out["input_ids"].shape[1] == 16 + 4
    assert out["hidden_index"][2].tolist()[:5] == list(range(15, 20))  # every scored position in place
