"""The hf rollout's own decode loop (`GraphDecoder`) against transformers `generate`, and its sampler."""

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig, StaticCache
from transformers.generation.logits_process import TopPLogitsWarper

from zbench.engine.rollout import (
    GQA_DECODE,
    GraphDecoder,
    HFRollout,
    chain_lengths,
    chained_schedule,
    gqa_decode_attention,
    inductor_has_pdl,
    one_prompt_width,
    resolve_decode_attention,
    response_mask_from,
    sample_tokens,
    use_gqa_decode_attention,
)


@pytest.fixture(autouse=True)
def fresh_compiler():
    """On CUDA each test compiles its decode steps afresh: dynamo keeps the compiled versions of `GraphDecoder`'s step
    on the function, shared by every decoder in the process, and past `recompile_limit` (8) a new one runs eagerly,
    which would leave a test of the recorded step testing the eager loop."""
    if torch.cuda.is_available():
        torch._dynamo.reset()
    yield


@pytest.fixture
def tiny(tiny_loaded):
    """The tiny model (a copy per test: `GraphDecoder` merges its projections and switches its attention in place)
    and six left-padded chat prompts."""
    model, *rest = tiny_loaded
    return copy.deepcopy(model), *rest


def test_an_unknown_compile_mode_is_refused_before_the_model_is_touched(tiny):
    model = tiny[0]
    q_proj, attention = model.model.layers[0].self_attn.q_proj, model.config._attn_implementation
    with pytest.raises(ValueError, match="compile_mode 'max_autotune': one of reduce-overhead, max-autotune"):
        GraphDecoder(model, compile=False, compile_mode="max_autotune", attention="triton")
    assert model.model.layers[0].self_attn.q_proj is q_proj  # projections not merged
    assert model.config._attn_implementation == attention  # attention not switched


def test_the_loop_reports_the_triton_attentions_switches_as_it_runs_them(tiny, monkeypatch):
    """`decode_kernels` (result.json's `graph_decode_kernels`): the switches of `zbench.engine.decode_attention` as
    read when the loop runs, and programmatic dependent launch only where the step is compiled on a GPU that has it
    (never on a CPU); nothing with SDPA."""
    from zbench.engine import decode_attention

    assert GraphDecoder(copy.deepcopy(tiny[0]), compile=False, attention="sdpa").decode_kernels is None
    triton = GraphDecoder(tiny[0], compile=False, attention="triton")
    assert triton.decode_kernels == {"dense": True, "one_grid": True, "pdl": False, "inductor_pdl": False}
    monkeypatch.setattr(decode_attention, "ONE_GRID", False)
    assert triton.decode_kernels == {"dense": True, "one_grid": False, "pdl": False, "inductor_pdl": False}
    assert not decode_attention.pdl_applies(torch.device("cpu"))


def test_steps_split_into_runs_that_never_pass_the_last(tiny):
    """`chain_lengths`: full runs of `steps_per_graph` decode steps, then the rest; a decoder off CUDA replays one
    step at a time whatever it was asked, and so does one drawing between steps (top_p below 1)."""
    assert chain_lengths(510, 8) == [8] * 63 + [6]
    assert chain_lengths(16, 8) == [8, 8] and chain_lengths(3, 8) == [3] and chain_lengths(0, 8) == []
    assert chain_lengths(5, 1) == [1] * 5
    with pytest.raises(ValueError, match="steps_per_graph 0: the decode steps one CUDA graph holds, at least 1"):
        GraphDecoder(copy.deepcopy(tiny[0]), compile=False, steps_per_graph=0)
    with pytest.raises(ValueError, match="sync_every 0: tokens between checks for all rows done, at least 1"):
        GraphDecoder(copy.deepcopy(tiny[0]), compile=False, sync_every=0)
    eager = GraphDecoder(tiny[0], compile=False, steps_per_graph=8)
    assert eager.steps_per_graph == 1 and eager.steps_a_graph(1.0) == 1
    eager.steps_per_graph = 8  # as on CUDA: still one step a replay where the draw runs between steps
    assert eager.steps_a_graph(0.9) == 1


@pytest.mark.parametrize(("tokens", "sync_every", "per_graph"),
                         [(24, 8, 4), (512, 64, 8), (512, 64, 5), (23, 6, 4), (10, 1, 4), (5, 64, 4), (2, 8, 4),
                          (1, 8, 4)])
def test_chained_steps_stop_after_the_steps_one_step_a_replay_runs(tokens, sync_every, per_graph):
    """`chained_schedule`, as `_replay_chained` follows it (a checked entry returns where all rows are done, else all
    its runs replay): whichever token the last row ends at, the steps run are those `_generate_in_graph` runs one a
    replay, checking before step t where t is a multiple of `sync_every`. Step 1 runs alone; no run is longer than
    `per_graph` or passes a check; the entries cover steps 1 .. tokens - 1 once each, in order."""
    schedule = chained_schedule(tokens, sync_every, per_graph)
    covered = [t for start, _, lengths in schedule for t in range(start, start + sum(lengths))]
    assert covered == list(range(1, tokens))
    assert schedule[:1] == ([] if tokens < 2 else [(1, sync_every == 1, [1])])
    for start, _, lengths in schedule[1:]:
        assert lengths and all(1 <= n <= per_graph for n in lengths)
        assert not any(t % sync_every == 0 for t in range(start + 1, start + sum(lengths)))
    for last_row_ends in range(tokens + 1):  # all rows done once this token is drawn
        one = []
        for t in range(1, tokens):
            if t % sync_every == 0 and t > last_row_ends:
                break
            one.append(t)
        chained = []
        for start, check, lengths in schedule:
            if check and start > last_row_ends:
                break
            chained.extend(range(start, start + sum(lengths)))
        assert chained == one, last_row_ends


def test_greedy_loop_equals_generate_with_left_padding_and_eos(tiny):
    model, pad_id, eos_ids, input_ids, mask = tiny
    assert (mask == 0).any()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=24, pad_token_id=pad_id, eos_token_id=eos_ids)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    ref = sdpa.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)[:, input_ids.shape[1]:]
    ours = GraphDecoder(model, compile=False, sync_every=4).generate(
        input_ids, mask, max_new_tokens=24, temperature=0.0, top_p=1.0, pad_id=pad_id, eos_ids=eos_ids,
        generator=None)
    ref = torch.cat([ref, ref.new_full((ref.shape[0], 24 - ref.shape[1]), pad_id)], dim=1)
    # the tiny model answers and stops: EOS is produced and everything after it is padding, as with generate
    assert response_mask_from(ours, eos_ids, pad_id).sum(1).lt(24).any()
    assert torch.equal(ours, ref)


def test_prefill_runs_each_distinct_prompt_once_from_the_first_attended_column(tiny):
    """GRPO's samples of a prompt arrive as equal rows, and the replica pads every batch to one wide width: the
    prefill computes each distinct prompt once (a row of the same tokens under another mask is another prompt), from
    the first column any row attends, and every row decodes as it would after a prefill of its own at the full
    width (greedy tokens equal generate's, in float32)."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    rows = torch.tensor([0, 0, 0, 1, 1, 4, 4, 2, 2])  # prompts 0, 1, 4, 2 repeated, as a step's n samples
    extra = 7  # more left padding than any prompt has
    ids = F.pad(input_ids[rows], (extra, 0), value=pad_id)
    attend = F.pad(mask[rows], (extra, 0))
    attend[-1, attend[-1].argmax()] = 0  # the last copy of prompt 2 without its first token: the same ids, masked
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: shapes.append(args[0].shape))
    ours = GraphDecoder(model, compile=False, sync_every=4).generate(
        ids, attend, max_new_tokens=20, temperature=0.0, top_p=1.0, pad_id=pad_id, eos_ids=eos_ids, generator=None)
    hook.remove()
    # 5 distinct prompts, from the first column one of them attends: the longest prompt's width
    assert shapes[0] == (5, int(mask[rows].sum(1).max())) and ids.shape[1] > shapes[0][1] + extra
    assert all(shape[1] == 1 for shape in shapes[1:])  # then one token a step
    cfg = GenerationConfig(do_sample=False, max_new_tokens=20, pad_token_id=pad_id, eos_token_id=eos_ids)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    ref = sdpa.generate(input_ids=ids, attention_mask=attend, generation_config=cfg)[:, ids.shape[1]:]
    ref = torch.cat([ref, ref.new_full((ref.shape[0], 20 - ref.shape[1]), pad_id)], dim=1)
    assert torch.equal(ours, ref)
    # sampled, the copies of a prompt draw their own responses
    sampled = GraphDecoder(copy.deepcopy(model), compile=False).generate(
        ids, attend, max_new_tokens=20, temperature=1.0, top_p=1.0, pad_id=pad_id, eos_ids=eos_ids,
        generator=torch.Generator().manual_seed(3))
    assert not torch.equal(sampled[0], sampled[1]) or not torch.equal(sampled[1], sampled[2])


def test_a_sliding_window_model_prefills_every_row_at_the_full_width(tiny):
    """A layer whose static cache keeps only a window (or anything but transformers' plain StaticLayer) takes no
    scratch-cache copy: every row is prefilled at the full width, and decodes as generate does."""
    model, pad_id, _, input_ids, mask = tiny
    config = copy.deepcopy(model.config)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window, config.use_sliding_window = 16, True
    torch.manual_seed(0)
    windowed = AutoModelForCausalLM.from_config(config).eval()
    rows = torch.tensor([0, 0, 3])
    ids, attend = input_ids[rows], mask[rows]
    shapes = []
    hook = windowed.get_input_embeddings().register_forward_hook(lambda _m, args, _out: shapes.append(args[0].shape))
    ours = GraphDecoder(copy.deepcopy(windowed), compile=False).generate(
        ids, attend, max_new_tokens=12, temperature=0.0, top_p=1.0, pad_id=pad_id, eos_ids=[], generator=None)
    hook.remove()
    assert shapes[0] == ids.shape  # no distinct-prompt prefill
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=pad_id)
    windowed.set_attn_implementation("sdpa")
    ref = windowed.generate(input_ids=ids, attention_mask=attend, generation_config=cfg)[:, ids.shape[1]:]
    assert torch.equal(ours, ref)


def test_sampling_repeats_per_seed_and_the_rollout_masks_after_eos(tiny):
    model, pad_id, eos_ids, input_ids, mask = tiny
    rollout = HFRollout(model, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=16, temperature=1.0, top_p=0.9,
                        static_cache=False, device=torch.device("cpu"), cuda_graph=True)
    a, b, c = (rollout.generate(input_ids, mask, seed) for seed in (5, 5, 6))
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])
    assert a["responses"].shape == (input_ids.shape[0], 16)
    assert torch.equal(a["response_mask"], response_mask_from(a["responses"], eos_ids, pad_id))


def test_top_p_keeps_the_same_nucleus_as_transformers():
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.3, 0.9, 0.999):
        expected = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        # sample many times: every sampled token lies in the nucleus, and the nucleus is covered
        g = torch.Generator().manual_seed(1)
        seen = torch.zeros_like(expected)
        for _ in range(400):
            tok = sample_tokens(logits, 1.0, top_p, g)
            assert expected.gather(1, tok[:, None]).all()
            seen.scatter_(1, tok[:, None], True)
        if top_p == 0.3:
            assert torch.equal(seen, expected)


def test_exponential_race_draws_from_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits.expand(2000, -1), 0.7, 1.0, g) for _ in range(5)]).flatten()
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    expected = (logits[0] / 0.7).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.01)  # 10k draws: standard error under 0.005
    assert freq[4] == 0
    assert torch.equal(sample_tokens(logits, 0.0, 1.0, None), torch.tensor([0]))


def test_compiled_decode_step_matches_the_eager_loop(tiny):
    """The decode step through torch.compile (on CUDA it is also captured as a CUDA graph) gives the eager
    loop's tokens, and a second call of the same shape reuses the compiled step."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    kwargs = {"max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    eager = GraphDecoder(model, compile=False).generate(input_ids, mask, **kwargs)
    compiled = GraphDecoder(model, compile=True)
    assert torch.equal(compiled.generate(input_ids, mask, **kwargs), eager)
    assert torch.equal(compiled.generate(input_ids, mask, **kwargs), eager)


def test_one_prompt_width_only_where_a_recorded_loop_skips_the_padding(tiny):
    """The compiled loop with the Triton attention pads to the longest admitted prompt, rounded up to the trainer's
    bucket multiple; SDPA (which reads the padding) and the eager loop (which records nothing) keep widths as they
    come. A CPU replica's loop is eager."""
    assert one_prompt_width(512, True, "triton") == 512
    assert one_prompt_width(100, True, "triton") == 128
    assert one_prompt_width(100, False, "triton") is None  # a parked replica, a CPU
    assert one_prompt_width(100, True, "sdpa") is None
    assert one_prompt_width(None, True, "triton") is None
    model, pad_id, eos_ids, *_ = tiny
    rollout = HFRollout(model, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=4, temperature=0.0, top_p=1.0,
                        static_cache=False, device=torch.device("cpu"), cuda_graph=True, prompt_width=100)
    assert rollout.prompt_width is None


def test_one_kv_cache_is_held_at_a_time(tiny):
    """Prompt-width buckets change from step to step; the decoder keeps only the current bucket's cache."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    decoder = GraphDecoder(model, compile=False)
    wide_ids = torch.cat([input_ids.new_full((input_ids.shape[0], 5), pad_id), input_ids], dim=1)
    wide_mask = torch.cat([mask.new_zeros((mask.shape[0], 5)), mask], dim=1)
    kwargs = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    narrow = decoder.generate(input_ids, mask, **kwargs)
    wide = decoder.generate(wide_ids, wide_mask, **kwargs)
    assert decoder._cache_slot is not None and decoder._cache_slot[0][:2] == (input_ids.shape[0], wide_ids.shape[1] + 6)
    assert torch.equal(narrow, wide)  # extra left padding changes nothing


def _decode_logits(model, input_ids, mask, steps: int) -> torch.Tensor:
    """Prefill, then `steps` one-token steps (each feeding back the argmax) over a static cache."""
    batch, width = input_ids.shape
    cache = StaticCache(config=model.config, max_cache_len=width + steps + 3)  # unfilled tail stays masked
    full = torch.zeros(batch, width + steps + 3, dtype=torch.long)
    full[:, :width] = mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=full, position_ids=pos, past_key_values=cache).logits[:, -1]
    out = [logits]
    pos = pos[:, -1:]
    for t in range(steps):
        full[:, width + t] = 1
        pos = pos + 1
        logits = model(input_ids=logits.argmax(-1, keepdim=True), attention_mask=full, position_ids=pos,
                       past_key_values=cache).logits[:, -1]
        out.append(logits)
    return torch.stack(out, 1)


@torch.no_grad()
def test_gqa_decode_attention_equals_sdpa(tiny):
    """Folding the query heads onto their key/value head gives the logits of transformers' eager attention (which
    expands the cache with `repeat_kv`), left padding and unfilled static cache positions included; prompts
    (several query tokens) go through SDPA itself."""
    model, _, _, input_ids, mask = tiny
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    eager, folded = copy.deepcopy(model), copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    use_gqa_decode_attention(folded)
    assert folded.config._attn_implementation == GQA_DECODE
    expected, got = _decode_logits(eager, input_ids, mask, 6), _decode_logits(folded, input_ids, mask, 6)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, 1:], got[:, :1].expand_as(got[:, 1:]))  # the steps differ: a real decode


@torch.no_grad()
def test_gqa_decode_attention_falls_back_to_sdpa_for_a_position_bias(tiny):
    """A position bias (a tensor) sends the step through transformers' SDPA; a zero bias changes nothing."""
    model = tiny[0]
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    heads, kv, dim = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    query, key, value = (torch.randn(3, h, n, dim, generator=g) for h, n in ((heads, 1), (kv, 9), (kv, 9)))
    folded, _ = gqa_decode_attention(attn, query, key, value, None, scaling=attn.scaling)
    biased, _ = gqa_decode_attention(attn, query, key, value, None, scaling=attn.scaling,
                                     position_bias=torch.zeros(3, heads, 1, 9))
    assert biased.shape == folded.shape == (3, 1, heads, dim)
    assert torch.allclose(biased, folded, atol=1e-6)


def test_the_graph_loop_records_its_attention_and_refuses_triton_where_it_cannot_run(tiny, monkeypatch):
    """`auto` takes SDPA off CUDA (here: CPU tensors); asking for Triton's kernels where they cannot run is an
    error that says why; the rollout records what its graph loop runs (nothing without one)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, pad_id, eos_ids = tiny[:3]
    cpu = torch.device("cpu")
    config, dtype = model.config, torch.float32
    assert resolve_decode_attention("auto", cpu, config, dtype) == "sdpa"
    assert resolve_decode_attention("sdpa", cpu, config, dtype) == "sdpa"
    with pytest.raises(RuntimeError, match=r"rollout.decode_attention=triton: its kernels cannot run here"):
        resolve_decode_attention("triton", cpu, config, dtype)
    common = {"pad_id": pad_id, "eos_ids": eos_ids, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0,
              "static_cache": False, "device": cpu}
    assert HFRollout(copy.deepcopy(model), cuda_graph=True, **common).decode_attention == "sdpa"
    assert HFRollout(copy.deepcopy(model), cuda_graph=False, **common).decode_attention is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded decode step and Triton's kernels need CUDA")
def test_recorded_decode_step_with_triton_attention_equals_sdpa_on_cuda(tiny):
    """On CUDA the decode step is compiled and replayed as a CUDA graph, with the Triton kernels and the merged
    projections inside it: its greedy tokens are those of the same loop with SDPA and transformers' own projections,
    over left padding and two cache widths (two recordings)."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    kwargs = {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    ids, mask = input_ids.cuda(), mask.cuda()
    wide_ids = torch.cat([ids.new_full((ids.shape[0], 7), pad_id), ids], dim=1)
    wide_mask = torch.cat([mask.new_zeros((mask.shape[0], 7)), mask], dim=1)
    tokens = {}
    for attention, merge in (("sdpa", False), ("sdpa", True), ("triton", True)):
        decoder = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention=attention, merge=merge)
        assert decoder.merged_projections == (2 * model.config.num_hidden_layers if merge else 0)
        tokens[attention, merge] = [decoder.generate(i, m, **kwargs).cpu()
                                    for i, m in ((ids, mask), (wide_ids, wide_mask), (ids, mask))]
    for variant in (("sdpa", True), ("triton", True)):
        for reference, ours in zip(tokens["sdpa", False], tokens[variant], strict=True):
            assert torch.equal(ours, reference), variant
    assert torch.equal(tokens["triton", True][0], tokens["triton", True][1])  # extra left padding changes nothing
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:  # the kernels ran
        decoder.generate(ids, mask, **kwargs)
    assert any(e.name == "_partial" for e in prof.events()), "the recorded step fell back to SDPA"


def _grpo_rows_on_cuda(tiny) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """GRPO's rows on CUDA, 3 prompts x 4 samples, and greedy `generate` arguments for 24 tokens over them."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    kwargs = {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None, "samples": 4}
    return model, input_ids[:3].repeat_interleave(4, 0).cuda(), mask[:3].repeat_interleave(4, 0).cuda(), kwargs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded decode step and Triton's kernels need CUDA")
def test_recorded_step_reads_each_prompt_once_for_its_samples_on_cuda(tiny):
    """GRPO's rows on CUDA, 3 prompts x 4 samples: the recorded step that reads each prompt's keys once a run
    decodes the greedy tokens SDPA's recorded step decodes."""
    model, ids, mask, kwargs = _grpo_rows_on_cuda(tiny)
    sdpa = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="sdpa").generate(ids, mask, **kwargs)
    shared = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="triton")
    assert torch.equal(shared.generate(ids, mask, **kwargs), sdpa)
    assert shared.shared_prefix == (4, ids.shape[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                    or not inductor_has_pdl(),
                    reason="programmatic dependent launch needs a Hopper GPU or later, and Inductor's switch for it")
def test_recorded_step_with_programmatic_dependent_launch_decodes_the_same_tokens_on_cuda(tiny, monkeypatch):
    """`decode_attention.PDL` (the default) with Inductor's kernels of the step compiled for it, a smoke test: the
    recorded step compiles and replays with the kernels launched early and waiting, and GRPO's rows decode the tokens
    they decode without it. A missing wait is a race these few tokens may not expose; the interpreter cannot run the
    wait at all."""
    from zbench.engine import decode_attention

    model, ids, mask, kwargs = _grpo_rows_on_cuda(tiny)
    overlapped = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="triton")
    assert overlapped.pdl
    tokens = overlapped.generate(ids, mask, **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        overlapped.generate(ids, mask, **kwargs)
    assert any(e.name.startswith("_partial") for e in prof.events()), "the recorded step fell back to SDPA"
    monkeypatch.setattr(decode_attention, "PDL", False)
    plain = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="triton")
    assert not plain.pdl
    assert torch.equal(plain.generate(ids, mask, **kwargs), tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded decode step and Triton's kernels need CUDA")
def test_recorded_step_with_one_grid_decodes_the_same_tokens_on_cuda(tiny, monkeypatch):
    """`decode_attention.ONE_GRID` (the default): GRPO's rows, the shared prefix's programs and each row's own in one
    `_partials` launch, decode the tokens a launch a range decodes, compiled for the GPU (the interpreter tests do not
    compile the kernel)."""
    from zbench.engine import decode_attention

    model, ids, mask, kwargs = _grpo_rows_on_cuda(tiny)
    joined = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="triton")
    tokens = joined.generate(ids, mask, **kwargs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        joined.generate(ids, mask, **kwargs)
    names = {e.name for e in prof.events()}
    assert "_partials" in names and "_partial" not in names
    monkeypatch.setattr(decode_attention, "ONE_GRID", False)
    ranges = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention="triton")
    assert torch.equal(ranges.generate(ids, mask, **kwargs), tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded decode step and Triton's kernels need CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_steps_captured_several_to_a_graph_draw_the_tokens_of_one_a_replay_on_cuda(tiny, attention):
    """`steps_per_graph` 4 with checks for all rows done every 8 tokens: GRPO's rows, sampled at temperature 1, draw
    the tokens the recorded step draws one step a replay, and leave the same cache, mask and loop state behind (the
    tiny model ends its rows early, by token 11-17 in a CPU check, so where the check at token 16 finds them all
    done both stop there). Of up to 23 steps the first runs the compiled step as it is, then runs of 4 and 2
    (tokens 2-7), of 4 (8-15, 16-23) replay captured graphs. Rollouts at one prompt width, a wider one whose EOS
    id lies outside the vocabulary, so that it runs all 23 steps (a new cache: the graphs and their pool go), then
    the first width again (captured anew), each from its own seed."""
    model, ids, mask, kwargs = _grpo_rows_on_cuda(tiny)
    kwargs = kwargs | {"temperature": 1.0}
    wide = (torch.nn.functional.pad(ids, (8, 0), value=kwargs["pad_id"]), torch.nn.functional.pad(mask, (8, 0)))
    never = [model.config.vocab_size + 1]
    batches = [(ids, mask, kwargs["eos_ids"]), (*wide, never), (ids, mask, kwargs["eos_ids"])]

    def rollouts(decoder: GraphDecoder) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        out = []
        for seed, (rows, kept, eos_ids) in enumerate(batches):
            tokens = decoder.generate(rows, kept, **kwargs | {"eos_ids": eos_ids,
                                                              "generator": torch.Generator("cuda").manual_seed(seed)})
            _, cache, loop_mask, state = decoder._cache_slot
            left = {"mask": loop_mask} | {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
            for i, layer in enumerate(cache.layers):
                left |= {f"layer {i} {name}": getattr(layer, name) for name in ("keys", "values", "cumulative_length")}
            out.append((tokens, {name: t.clone() for name, t in left.items()}))
        return out

    one = rollouts(GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention=attention, sync_every=8))
    chained = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention=attention, steps_per_graph=4,
                           sync_every=8)
    assert chained.steps_per_graph == 4
    got = rollouts(chained)
    assert {key[-1] for key in chained._chains} <= {4, 2} and 4 in {key[-1] for key in chained._chains}
    for (tokens, left), (expected, expected_left) in zip(got, one, strict=True):
        assert torch.equal(tokens, expected)
        assert left.keys() == expected_left.keys()
        assert [name for name in left if not torch.equal(left[name], expected_left[name])] == []
    assert not torch.equal(got[0][0], got[2][0])  # the seeds drew apart: the draws were not all the same token
    assert int(got[1][1]["step"]) == 23  # the rollout that cannot end ran every step


class HostReleasableMemory:
    """`device_memory.ReleasableMemory` on the host, for the placement of the loop's cache where the CPU has no
    virtual memory management: one buffer at one address, whose `release` leaves NaN behind (what the pages mapped
    again may hold) and whose `restore` keeps it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.address, self.nbytes, self.held = self.tensor.data_ptr(), nbytes, True

    def release(self) -> None:
        self.tensor.view(torch.float32).fill_(float("nan"))
        self.held = False

    def restore(self) -> None:
        self.held = True


def test_the_loop_places_its_cache_in_one_releasable_range_and_samples_as_one_that_holds_it(tiny, monkeypatch):
    """The loop's placement of every layer's keys and values in one releasable range (what runs on CUDA, here over
    host memory): each layer's tensors shaped as transformers' own, disjoint, inside the range, at the same addresses
    each rollout; whatever the released range holds when mapped again, the rollouts are those of a loop that holds
    its cache, seed for seed."""
    from zbench.engine import device_memory

    model, pad_id, eos_ids, input_ids, mask = tiny
    monkeypatch.setattr(device_memory, "ReleasableMemory", HostReleasableMemory)
    kwargs = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids}
    held = GraphDecoder(copy.deepcopy(model), compile=False)
    placed = GraphDecoder(copy.deepcopy(model), compile=False, release_cache=True)
    placed.cache_at_fixed_addresses = True  # as on CUDA, where the device maps memory at fixed addresses
    addresses = None
    for seed in (1, 2, 1):
        expected = held.generate(input_ids, mask, generator=torch.Generator().manual_seed(seed), **kwargs)
        got = placed.generate(input_ids, mask, generator=torch.Generator().manual_seed(seed), **kwargs)
        assert torch.equal(got, expected), seed
        memory, own = placed._cache_memory, held._cache_slot[1].layers
        layers = placed._cache_slot[1].layers
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                       for layer in layers for t in (layer.keys, layer.values))
        assert spans[0][0] == memory.address and spans[-1][1] == memory.address + memory.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # disjoint, back to back
        for mine, theirs in zip(layers, own, strict=True):
            assert mine.keys.shape == theirs.keys.shape and mine.values.dtype == theirs.values.dtype
            assert (mine.batch_size, mine.num_heads, mine.k_head_dim, mine.v_head_dim) == (
                theirs.batch_size, theirs.num_heads, theirs.k_head_dim, theirs.v_head_dim)
        assert addresses in (None, spans)
        addresses = spans
        placed.free_cache()
        assert not memory.held and placed._cache_slot is not None  # pages released, the cache and its graphs kept
        assert layers[0].keys.isnan().all()


def test_the_eager_loop_drops_its_cache_after_each_rollout_and_samples_as_one_that_holds_it(tiny):
    """Run eagerly (a CPU), a loop that releases its cache drops it after each rollout and allocates it again: its
    rollouts are those of a loop that holds its cache, seed for seed."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    common = {"pad_id": pad_id, "eos_ids": eos_ids, "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0,
              "static_cache": False, "device": torch.device("cpu"), "cuda_graph": True}
    held = HFRollout(copy.deepcopy(model), **common)
    released = HFRollout(copy.deepcopy(model), release_kv_cache=True, **common)
    assert (held.kv_cache, released.kv_cache) == ("held", "dropped")
    for seed in (1, 2, 1):
        a, b = held.generate(input_ids, mask, seed), released.generate(input_ids, mask, seed)
        assert torch.equal(a["responses"], b["responses"])
        assert released.graph._cache_slot is None and held.graph._cache_slot is not None
        assert "sleep" in released.seconds and "sleep" not in held.seconds
        assert released.awake_used_gb == 0.0  # no GPU to sample

    def broken_prefill(*args, **kwargs):
        raise RuntimeError("prefill failed")

    released.graph._prefill = broken_prefill  # a rollout that raises still gives its cache back
    with pytest.raises(RuntimeError, match="prefill failed"):
        released.generate(input_ids, mask, 3)
    assert released.graph._cache_slot is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the recorded decode step and its memory need CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_the_recorded_loop_gives_its_cache_back_and_replays_over_it(tiny, attention, monkeypatch):
    """Compiled on CUDA, a loop that releases its cache unmaps it after each rollout (the device's free memory rises
    by the cache's size) and maps it again at the same addresses, which the recorded step replays over without
    recording again; it samples what a loop holding its cache samples, seed for seed, with GRPO's runs of samples
    too."""
    from torch._inductor import cudagraph_trees

    recordings = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counted(self, *args, **kwargs):
        recordings.append(1)
        return record(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counted)
    model, pad_id, eos_ids, input_ids, mask = tiny
    ids, mask = input_ids[:3].repeat_interleave(4, 0).cuda(), mask[:3].repeat_interleave(4, 0).cuda()
    kwargs = {"max_new_tokens": 20, "temperature": 1.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "samples": 4}
    held = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention=attention)
    released = GraphDecoder(copy.deepcopy(model).cuda(), compile=True, attention=attention, release_cache=True)
    assert released.cache_at_fixed_addresses and released.release_cache and not held.cache_at_fixed_addresses
    device = ids.device
    addresses = None
    for rollout, seed in enumerate((7, 8, 7)):
        expected = held.generate(ids, mask, generator=torch.Generator(device).manual_seed(seed), **kwargs)
        before = len(recordings)
        got = released.generate(ids, mask, generator=torch.Generator(device).manual_seed(seed), **kwargs)
        # its first rollout records its own step (its cache's addresses are not the held loop's); later ones replay
        assert (len(recordings) > before) is (rollout == 0), rollout
        assert torch.equal(got, expected), seed
        memory = released._cache_memory
        assert memory.held
        layers = released._cache_slot[1].layers  # every layer's keys and values in the one released range
        now = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers]
        assert all(memory.address <= p < memory.address + memory.nbytes for pair in now for p in pair)
        assert addresses in (None, now)  # the same addresses each rollout
        addresses = now
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info(device)[0]
        released.free_cache()
        assert not memory.held and torch.cuda.mem_get_info(device)[0] - before >= memory.nbytes
        if rollout == 0:
            first = len(recordings)
    assert len(recordings) == first  # neither loop recorded again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compiled kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_decode_attention_in_half_precision_on_cuda(dtype):
    """The kernels as a bf16 / fp16 model runs them (the CPU interpreter cannot multiply half-precision tiles): no
    further from float32 SDPA than SDPA in the same precision, over left padding and an unfilled tail."""
    from zbench.engine.decode_attention import decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, length in ((32, 704), (5, 100), (128, 896)):
        q = torch.randn(batch, 8, 2, 128, device="cuda", generator=g).to(dtype)
        k, v = (torch.randn(batch, 8, length, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
        mask = torch.zeros(batch, length, dtype=torch.bool, device="cuda")
        for row in range(batch):
            mask[row, (row * 7) % (length // 3): length - (row * 13) % (length // 2)] = True
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :])
        ours = decode_attention(q, k, v, mask, 128 ** -0.5)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        ours_err, sdpa_err = ((t.float() - exact).abs().max().item() for t in (ours, theirs))
        assert ours.dtype == dtype and ours_err <= 2 * sdpa_err + 1e-3, (batch, length, ours_err, sdpa_err)
        if batch % 4 == 0:  # runs of 4 rows with one prompt's keys over the first third: read once a run
            prefix = length // 3
            for part in (k, v):
                part[:, :, :prefix] = part[::4, :, :prefix].repeat_interleave(4, 0)
            mask[:, :prefix] = mask[::4, :prefix].repeat_interleave(4, 0)
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :])
            shared = decode_attention(q, k, v, mask, 128 ** -0.5, 4, prefix)
            assert (shared.float() - exact).abs().max().item() <= 2 * sdpa_err + 1e-3, (batch, length, "shared")


def test_bench_gen_graph_says_which_attention_ran_and_agrees_with_generate(monkeypatch):
    """`zbench bench gen --decode graph` measures the loop with the attention a case would get and records it; on
    a CPU that is SDPA, and its greedy tokens are `generate`'s."""
    from zbench.bench import generation

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = generation("tiny", prompts=2, prompt_len=8, new_tokens=4, decode="graph", repeats=1)
    assert result["decode_attention"] == "sdpa" and result["device"] == "cpu"
    assert result["greedy_identical_rows"] == 2 and result["generated_tokens_per_s"] > 0
    assert "decode_attention" not in generation("tiny", prompts=2, prompt_len=8, new_tokens=4, decode="generate",
                                                repeats=1)


def test_the_prefill_runs_every_layer_through_one_compiled_graph(tiny):
    """With `compile_prefill`, the prefill runs each decoder layer through one compiled graph, shared by all layers
    and shapes (batches of other widths and prompt counts compile nothing new), each layer writing its own keys and
    values, and decodes the eager prefill's greedy tokens; after it the layers are as they were (their own call,
    their `layer_idx`), so the decode steps run them uncompiled here (`compile=False`). A layer called without its
    cache says how to turn the compiled prefill off."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    kwargs = {"max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    eager = GraphDecoder(copy.deepcopy(model), compile=False)
    compiled = GraphDecoder(model, compile=False, compile_prefill=True, prefill_backend=counting)
    assert not eager.prefill_compiled and compiled.prefill_compiled
    layers = model.model.layers
    assert len(layers) > 1 and [layer.self_attn.layer_idx for layer in layers] == list(range(len(layers)))
    assert torch.equal(compiled.generate(input_ids, mask, **kwargs), eager.generate(input_ids, mask, **kwargs))
    assert len(graphs) == 1 and graphs[0] < 200  # one layer's graph, not the model's
    for rows, cut in ((slice(1, 5), 2), (slice(0, 6, 2), 0)):  # narrower, fewer prompts
        batch = input_ids[rows, cut:], mask[rows, cut:]
        assert torch.equal(compiled.generate(*batch, **kwargs), eager.generate(*batch, **kwargs))
    assert len(graphs) == 1
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(len(layers)))
    assert all(layer._compiled_call_impl is None for layer in layers)
    with pytest.raises(RuntimeError, match=r"called without its KV cache .* set rollout.compile_prefill=false"):
        compiled._run_layer(layers[0], None, torch.zeros(1, 1, model.config.hidden_size))

    def failing(_gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    broken = GraphDecoder(copy.deepcopy(model), compile=False, compile_prefill=True, prefill_backend=failing)
    with pytest.raises(Exception, match="no compiler here"):
        broken.generate(input_ids, mask, **kwargs)
    broken_layers = broken.model.model.layers  # a prefill that raised leaves the layers as they were
    assert [layer.self_attn.layer_idx for layer in broken_layers] == list(range(len(broken_layers)))
    assert all(layer._compiled_call_impl is None for layer in broken_layers)
    torch._dynamo.reset()
