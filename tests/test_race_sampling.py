"""The graph loop's in-graph sampler (`zbench.engine.race_sampling`): the draws where Triton cannot run, and
`GraphDecoder`'s recorded step with the draw and bookkeeping inside (compiled on the CPU here; captured as one CUDA
graph on a GPU). Its Triton kernel runs in Triton's interpreter in `race_sampling_cases.py` (`test_triton_kernels`)."""

import copy

import pytest
import torch
from test_rollout import tiny  # noqa: F401  (the same model and prompts: tiny_loaded is in conftest)

from zbench.engine import race_sampling as rs
from zbench.engine.rollout import GraphDecoder, response_mask_from


def _at(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.skipif(rs.available(torch.device("cpu")), reason="Triton's interpreter is on: the kernel runs")
def test_without_triton_the_race_draws_from_the_softmax_with_a_generator():
    head = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    logits = head.expand(4000, -1)
    draws = torch.cat([rs.race(logits, _at(3), _at(step), 0.7) for step in range(5)])
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert torch.allclose(freq, (head / 0.7).softmax(-1), atol=0.01) and freq[4] == 0
    assert torch.equal(draws[:4000], rs.race(logits, _at(3), _at(0), 0.7))
    assert torch.equal(rs.race(logits, _at(3), _at(0), 0.0), logits.argmax(-1))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="seed must be one int64"):
        rs.race(torch.zeros(2, 8), torch.tensor([1], dtype=torch.int32), _at(0), 1.0)
    with pytest.raises(ValueError, match="rows, vocabulary"):
        rs.race(torch.zeros(8), _at(1), _at(0), 1.0)


@pytest.mark.parametrize("rows, vocab", [(1, 10), (32, 151936), (128, 151936), (4000, 1505), (8, 700)])
def test_slices_cover_the_vocabulary_in_whole_iterations(rows, vocab):
    count, chunk = rs.splits(rows, vocab)
    assert 1 <= count <= rs.MAX_SPLITS and chunk % (4 * rs.QUARTER) == 0
    assert count * chunk >= vocab and (count - 1) * chunk < vocab  # every slice holds columns of the vocabulary


def test_the_recorded_step_draws_repeatably_and_keeps_the_books(tiny):  # noqa: F811
    """Compiled, the loop draws inside its recorded step (`GraphDecoder._step`): a seed repeats its responses,
    another seed draws others, everything after a row's EOS is padding, and a batch whose rows are all done stops
    at the next check. Greedy, it gives the eager loop's tokens (`test_rollout`)."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    decoder = GraphDecoder(copy.deepcopy(model), compile=True, sync_every=4)
    assert decoder.sample_in_graph
    kwargs = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids}
    a, b, c = (decoder.generate(input_ids, mask, generator=torch.Generator().manual_seed(s), **kwargs)
               for s in (4, 4, 5))
    assert torch.equal(a, b) and not torch.equal(a, c)
    lengths = response_mask_from(a, eos_ids, pad_id).sum(1)
    assert lengths.lt(40).any()  # the tiny model stops
    for row, length in zip(a, lengths.tolist(), strict=True):
        assert (row[length:] == pad_id).all()
    # the loop stops at the first check (every 4 tokens) after every row's EOS: the last step it ran drew the
    # token before that check (c was drawn last)
    longest = int(response_mask_from(c, eos_ids, pad_id).sum(1).max())
    check = -(-max(longest, 1) // 4) * 4
    assert int(decoder._cache_slot[3].step) == min(check, 40) - 1
    eager = GraphDecoder(copy.deepcopy(model), compile=False, sync_every=4)
    assert not eager.sample_in_graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded step and the race kernel need CUDA")
def test_the_recorded_step_with_its_draw_on_cuda(tiny):  # noqa: F811
    """On CUDA the step with its draw is one recorded graph: greedy, its tokens are the eager loop's (which draws
    between steps); sampled, a seed repeats its responses across replays and another seed draws others, and the
    race kernel ran inside the graph in place of the eager softmax."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    ids, mask = input_ids.cuda(), mask.cuda()
    kwargs = {"max_new_tokens": 24, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids}
    eager = GraphDecoder(copy.deepcopy(model).cuda(), compile=False).generate(
        ids, mask, temperature=0.0, generator=None, **kwargs)
    recorded = GraphDecoder(copy.deepcopy(model).cuda(), compile=True)
    assert recorded.sample_in_graph
    assert torch.equal(recorded.generate(ids, mask, temperature=0.0, generator=None, **kwargs), eager)

    def sampled(seed: int) -> torch.Tensor:
        return recorded.generate(ids, mask, temperature=1.0, generator=torch.Generator("cuda").manual_seed(seed),
                                 **kwargs)

    first = sampled(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        again = sampled(8)
    assert torch.equal(first, again) and not torch.equal(first, sampled(9))
    names = {e.name for e in prof.events()}
    assert "_race" in names and not any("SoftMax" in name for name in names)
