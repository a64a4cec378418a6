"""The decode step's Triton attention (`zbench.engine.decode_attention`) against SDPA, on CPU tensors through
Triton's interpreter: the kernels alone over masks with left padding, holes, an unwritten tail and a row that attends
nothing; then the whole model's decode logits and `GraphDecoder`'s tokens with the kernels against the SDPA path.

Triton reads `TRITON_INTERPRET` when it is imported, so these cases run in a process of their own that sets it first
(`test_triton_kernels.py`); collected anywhere else they skip."""

import copy
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run through test_triton_kernels.py",
                allow_module_level=True)
pytest.importorskip("triton")

from test_rollout import _decode_logits, tiny  # noqa: F401  (the same model, prompts and decode helper)

from zbench.engine import decode_attention as da
from zbench.engine.rollout import (
    GQA_DECODE_SKIPPING,
    GraphDecoder,
    HFRollout,
    gqa_decode_attention,
    gqa_decode_attention_skipping,
    resolve_decode_attention,
    use_gqa_decode_attention,
)


def _config(**fields):
    return SimpleNamespace(**({"hidden_size": 2048, "num_attention_heads": 16, "head_dim": 128} | fields))


def test_the_interpreter_runs_the_kernels_on_cpu_tensors_when_asked():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert da.available(cpu)
    assert resolve_decode_attention("triton", cpu, _config(), bf16) == "triton"
    assert resolve_decode_attention("auto", cpu, _config(), bf16) == "sdpa"  # never the (slow) interpreter unasked


@pytest.mark.parametrize(("fields", "dtype", "why"), [
    ({"head_dim": 80}, torch.bfloat16, r"heads of \[80\] dimensions in bfloat16"),  # Phi-2
    ({"head_dim": 256}, torch.float32, r"heads of \[256\] dimensions in float32"),  # too much shared memory
    ({"head_dim": 64, "v_head_dim": 128, "qk_head_dim": 192}, torch.bfloat16, r"heads of \[64, 128, 192\]"),
    ({"attn_logit_softcapping": 50.0}, torch.bfloat16, r"softcapped attention logits"),  # Gemma-2
    ({"model_type": "gpt_oss"}, torch.bfloat16, r"attention sinks"),
])
def test_models_the_kernels_do_not_compute_are_named(fields, dtype, why):
    """`triton` for a model whose every layer would fall back to SDPA is an error naming why; `auto` keeps SDPA."""
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"the kernels do not compute this model's attention \(" + why):
        resolve_decode_attention("triton", cpu, _config(**fields), dtype)
    assert da.unsupported(_config(head_dim=256), torch.bfloat16) is None  # bf16 heads of 256 fit


@pytest.fixture
def op_calls(monkeypatch):
    """The calls that reach the kernels (the attention imports the op at each call): each query's shape, and the
    shared prefix (share, prefix) the call was given."""
    calls = []
    real = da.decode_attention

    def counted(*args, **kwargs):
        calls.append((args[0].shape, *args[5:7]))  # the query's shape, and (share, prefix) as the hook passes them
        return real(*args, **kwargs)

    monkeypatch.setattr(da, "decode_attention", counted)
    return calls


def _masks(batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        start = int(torch.randint(0, length // 3, (), generator=g))
        end = int(torch.randint(length // 2, length + 1, (), generator=g))
        mask[row, start:end] = True
    mask[0, 1] = True  # a kept position inside the padding: a hole, not a range
    return mask


@pytest.mark.parametrize(("batch", "kv_heads", "group", "dim", "length"),
                         [(3, 2, 2, 64, 200), (2, 1, 3, 32, 70), (2, 2, 1, 16, 1100), (1, 1, 4, 16, 7)])
def test_kernels_equal_sdpa(batch, kv_heads, group, dim, length):
    g = torch.Generator().manual_seed(batch * length)
    q = torch.randn(batch, kv_heads, group, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = _masks(batch, length, g)
    got = da.decode_attention(q, k, v, mask, dim ** -0.5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=dim ** -0.5)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    # positions the mask leaves out are never read: garbage there changes nothing
    k2, v2 = k.masked_fill(~mask[:, None, :, None], float("nan")), v.masked_fill(~mask[:, None, :, None], 1e30)
    assert torch.equal(da.decode_attention(q, k2, v2, mask, dim ** -0.5), got)


def test_slices_kept_only_at_their_edges_or_not_at_all(monkeypatch):
    """Each program loops only between its slice's first and last kept positions: masks whose kept runs start or
    end on a slice's first or last position, one that keeps a single position, and whole slices kept nowhere
    between kept ones (length 1100 cuts into 8 slices of 192 at 4 blocks a slice)."""
    monkeypatch.setattr(da, "CHUNK_BLOCKS", 4)
    length = 1100
    assert da.slices(length) == (8, 192)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(5, 1, 2, 16, generator=g)
    k, v = (torch.randn(5, 1, length, 16, generator=g) for _ in range(2))
    mask = torch.zeros(5, length, dtype=torch.bool)
    mask[0, [0, 191, 192, 1099]] = True  # a slice's edges
    mask[1, 383:385] = True  # across a slice boundary
    mask[2, 1099] = True  # the last position alone
    mask[3, :10] = mask[3, 900:1000] = True  # slices 1-3 kept nowhere between kept ones
    mask[4, 64:128] = True  # one whole block
    got = da.decode_attention(q, k, v, mask, 0.25)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=0.25)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trim", [True, False])
def test_slices_longer_than_one_scan(monkeypatch, trim):
    """A cache of 20,000 positions cuts into 16 slices of 1,280, which the trim scans in two passes of 1,024: kept
    positions only in a slice's second pass, across the passes' boundary and across two slices' boundary; the
    untrimmed loop (`TRIM` off, the geometry sweep's other variant) gives the same."""
    monkeypatch.setattr(da, "TRIM", trim)
    length = 20_000
    assert da.slices(length) == (16, 1280)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(4, 1, 2, 16, generator=g)
    k, v = (torch.randn(4, 1, length, 16, generator=g) for _ in range(2))
    mask = torch.zeros(4, length, dtype=torch.bool)
    mask[0, [1024 + 5, 1280 + 1100, 19_999]] = True  # second passes of slices 0 and 1, and the last position
    mask[1, 1020:1030] = True  # across the boundary of a slice's two passes
    mask[2, 1275:1285] = True  # across two slices
    mask[3, 3 * 1280 + 1024: 5 * 1280 + 7] = True  # a second pass through to the next slice's first
    got = da.decode_attention(q, k, v, mask, 0.25)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=0.25)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    k2, v2 = k.masked_fill(~mask[:, None, :, None], float("nan")), v.masked_fill(~mask[:, None, :, None], 1e30)
    assert torch.equal(da.decode_attention(q, k2, v2, mask, 0.25), got)


@pytest.mark.parametrize("share", [1, 4])
def test_dense_slices_skip_the_mask_and_slices_with_holes_still_read_it(monkeypatch, share):
    """`DENSE`: a slice kept everywhere between its first and last kept positions loops without the mask. Rows as
    the decode loop keeps them (left padding, then every position to the current one), rows with holes, a row kept
    nowhere (without a shared prefix, whose runs agree on it), across slices and with a shared prefix: the result equals SDPA's, and positions masked off are never
    read (garbage there, NaN keys and huge values, changes nothing)."""
    monkeypatch.setattr(da, "DENSE", True)
    monkeypatch.setattr(da, "CHUNK_BLOCKS", 2)  # slices of 128: these rows cross several
    batch, length, dim, prefix = 8, 700, 32, 300
    g = torch.Generator().manual_seed(17 + share)
    q = torch.randn(batch, 2, 2, dim, generator=g)
    k, v = (torch.randn(batch, 2, length, dim, generator=g) for _ in range(2))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row, (start, end) in enumerate([(37, 520), (37, 520), (37, 520), (37, 520), (0, 700), (0, 700), (0, 700),
                                        (0, 700)]):
        mask[row, start:end] = True
    mask[4:, 310:320] = False  # holes past the prefix
    mask[5:8, 450] = False
    if share == 1:
        mask[7] = False  # a row kept nowhere
    else:  # runs agree over the prefix (their masks do already)
        k[:, :, :prefix] = k[::share, :, :prefix].repeat_interleave(share, 0)
        v[:, :, :prefix] = v[::share, :, :prefix].repeat_interleave(share, 0)
    got = da.decode_attention(q, k, v, mask, dim ** -0.5, share, prefix if share > 1 else 0)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=dim ** -0.5)
    if share == 1:
        expected[7] = 0.0  # SDPA's NaN for a row that attends nothing; the kernels give zeros
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    k2, v2 = k.masked_fill(~mask[:, None, :, None], float("nan")), v.masked_fill(~mask[:, None, :, None], 1e30)
    assert torch.equal(da.decode_attention(q, k2, v2, mask, dim ** -0.5, share, prefix if share > 1 else 0), got)


@pytest.mark.parametrize(("share", "group", "prefix", "length", "trim"), [
    (4, 2, 120, 300, True), (2, 3, 64, 300, True), (8, 1, 300, 300, True), (4, 2, 0, 300, True),
    (5, 3, 130, 300, True),  # a run of 5 rows of 3 heads: a 32-row tile, partly filled
    (8, 4, 65, 300, False),  # a full 32-row tile, each program looping over its whole slice
    (16, 4, 100, 300, True),  # 16 rows of 4 heads outgrow a tile: read in sub-runs of 8
    (4, 2, 600, 1100, True),  # 2 + 1 slices: the combine's tile of 4 has one never written
])
def test_a_shared_prefix_is_read_once_a_run(monkeypatch, share, group, prefix, length, trim):
    """Runs of `share` rows with equal keys, values and mask over the first `prefix` positions (GRPO's samples of
    a prompt): the result equals SDPA's, and it reads that part from each run's first row only (garbage in the
    other rows' prefix changes nothing), while past the prefix every row still reads its own. `ONE_GRID` (both
    ranges in one launch) gives what a launch a range gives, to the last bits: the same slices into the same slots
    (a larger tile than a range's own may add in another order: compiled, and in the interpreter of the packages
    of 2026-11-29, Triton 3.9)."""
    monkeypatch.setattr(da, "TRIM", trim)
    monkeypatch.setattr(da, "ONE_GRID", False)
    batch, dim = 2 * share, 32
    g = torch.Generator().manual_seed(share * 100 + prefix)
    q = torch.randn(batch, 2, group, dim, generator=g)
    k, v = (torch.randn(batch, 2, length, dim, generator=g) for _ in range(2))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        lead = row // share * share
        mask[row, 20 + 7 * (row // share): prefix] = True  # the run's prompt, left-padded by run
        mask[row, prefix: prefix + 30 + 17 * row] = True  # its own response so far
        k[row, :, :prefix], v[row, :, :prefix] = k[lead, :, :prefix], v[lead, :, :prefix]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=dim ** -0.5)
    got = da.decode_attention(q, k, v, mask, dim ** -0.5, share, prefix)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    sub = da.tile_share(share, da.triton.next_power_of_2(group))  # the rows a program reads for
    others = (torch.arange(batch) % sub != 0)[:, None, None, None] & (torch.arange(length) < prefix)[:, None]
    k2, v2 = k.masked_fill(others, float("nan")), v.masked_fill(others, 1e30)
    assert torch.equal(da.decode_attention(q, k2, v2, mask, dim ** -0.5, share, prefix), got)
    if prefix:  # without the promise, every row reads its own prefix: the garbage shows
        assert da.decode_attention(q, k2, v2, mask, dim ** -0.5).isnan().any()
    monkeypatch.setattr(da, "ONE_GRID", True)
    assert torch.allclose(da.decode_attention(q, k, v, mask, dim ** -0.5, share, prefix), got, atol=1e-6, rtol=1e-6)


def test_a_run_is_cut_into_sub_runs_that_fit_a_tile():
    assert da.tile_share(4, 2) == 4 and da.tile_share(16, 2) == 16 and da.tile_share(16, 4) == 8
    assert da.tile_share(12, 4) == 6 and da.tile_share(7, 8) == 1 and da.tile_share(3, 64) == 1
    assert da.slices(600, 8) == (2, 320) and da.slices(20_000, 8) == (8, 2560)  # a range's share of the slices
    # the launches of a call: the prefix's runs, then every row on its own; runs of 1 (or past a tile) share nothing
    assert da.plan(1100, 2, 4, 600) == [(0, 600, 4, 2, 320), (600, 1100, 1, 1, 512)]
    assert da.plan(1100, 2, 1, 600) == da.plan(1100, 2) == [(0, 1100, 1, 4, 320)]
    assert da.plan(300, 64, 3, 100) == [(0, 300, 1, 1, 320)]


def test_a_shared_prefix_needs_whole_runs():
    q, k = torch.randn(6, 1, 2, 16), torch.randn(6, 1, 40, 16)
    mask = torch.ones(6, 40, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"share=4, prefix=10 for 6 rows .* whole runs of `share`"):
        da.decode_attention(q, k, k, mask, 0.25, 4, 10)
    with pytest.raises(ValueError, match=r"and 0 <= prefix <= 40"):
        da.decode_attention(q, k, k, mask, 0.25, 2, 41)


def test_bad_inputs_are_refused_not_misread():
    q, k = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 40, 16)
    with pytest.raises(ValueError, match=r"the mask must be bool of shape \(2, 40\)"):
        da.decode_attention(q, k, k, torch.zeros(2, 40), 0.25)  # an additive mask would read inverted
    with pytest.raises(ValueError, match=r"the mask must be bool of shape \(2, 40\)"):
        da.decode_attention(q, k, k, torch.ones(2, 39, dtype=torch.bool), 0.25)  # short: reads past it
    with pytest.raises(ValueError, match=r"D a power of 2 from 16 to 256 \(128 in float32\)"):
        da.decode_attention(torch.randn(2, 1, 2, 80), torch.randn(2, 1, 40, 80), torch.randn(2, 1, 40, 80),
                            torch.ones(2, 40, dtype=torch.bool), 0.1)


def test_strided_inputs_and_a_broadcast_mask():
    """A query with a strided last dimension, a key sliced from a longer cache, a value from more heads, a mask
    expanded from one row (stride 0)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 2, 64, generator=g)[..., ::2]  # last stride 2: copied before the kernels
    k = torch.randn(3, 2, 100, 32, generator=g)[:, :, :80]  # a cache sliced along its positions: read in place
    v = torch.randn(3, 4, 80, 32, generator=g)[:, 1:3]  # every other head's stride
    mask = torch.zeros(80, dtype=torch.bool)
    mask[10:70] = True
    mask = mask.expand(3, 80)  # stride 0 over the rows
    got = da.decode_attention(q, k, v, mask, 0.2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=0.2)
    assert got.is_contiguous() and torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize(("dim", "mask_rows", "kernel_calls"), [
    (80, 3, 0),  # a head size that is no power of 2 (Phi-2's): SDPA, not the kernels
    (16, 1, 1),  # a mask made once for the whole batch: broadcast over the rows, as in SDPA
])
def test_the_model_hook_sends_what_the_kernels_take_to_them(tiny, op_calls, dim, mask_rows, kernel_calls):  # noqa: F811
    attn = tiny[0].model.layers[0].self_attn
    g = torch.Generator().manual_seed(dim)
    query = torch.randn(3, 4, 1, dim, generator=g)
    key, value = (torch.randn(3, 2, 40, dim, generator=g) for _ in range(2))
    mask = torch.zeros(mask_rows, 1, 1, 40, dtype=torch.bool)
    mask[..., 5:33] = True
    got, _ = gqa_decode_attention_skipping(attn, query, key, value, mask, scaling=0.25)
    expected, _ = gqa_decode_attention(attn, query, key, value, mask, scaling=0.25)
    assert len(op_calls) == kernel_calls and torch.allclose(got, expected, atol=1e-5)


def test_a_row_that_attends_nothing_gets_zeros():
    q, k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 16)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 3:9] = True
    out = da.decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = F.scaled_dot_product_attention(q[1:], k[1:], v[1:], attn_mask=mask[1:, None, None, :], scale=0.25)
    assert torch.allclose(out[1:], expected, atol=1e-5)


def test_slices_cover_the_cache():
    for length in (1, 63, 64, 255, 256, 257, 704, 5000, 100_000):
        splits, chunk = da.slices(length)
        assert splits & (splits - 1) == 0 and splits <= da.MAX_SPLITS
        assert chunk % da.BLOCK_N == 0 and splits * chunk >= length  # every position falls in a slice
        assert chunk <= da.CHUNK_BLOCKS * da.BLOCK_N or splits == da.MAX_SPLITS


@torch.no_grad()
def test_model_decode_logits_equal_the_sdpa_path(tiny, op_calls):  # noqa: F811
    """The whole model over a static cache (left padding, unfilled tail): the Triton path's logits equal SDPA's,
    and every layer's one-token step went through the kernels (none fell back to SDPA unseen)."""
    model, _, _, input_ids, mask = tiny
    sdpa, skipping = copy.deepcopy(model), copy.deepcopy(model)
    use_gqa_decode_attention(sdpa, "sdpa")
    use_gqa_decode_attention(skipping, "triton")
    assert skipping.config._attn_implementation == GQA_DECODE_SKIPPING
    expected = _decode_logits(sdpa, input_ids, mask, 5)
    assert not op_calls
    got = _decode_logits(skipping, input_ids, mask, 5)
    assert len(op_calls) == 5 * model.config.num_hidden_layers  # the prompt's pass is SDPA's: several query tokens
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_graph_decoder_tokens_equal_the_sdpa_path(tiny, op_calls):  # noqa: F811
    model, pad_id, eos_ids, input_ids, mask = tiny
    kwargs = {"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    sdpa = GraphDecoder(copy.deepcopy(model), compile=False, attention="sdpa").generate(input_ids, mask, **kwargs)
    assert not op_calls
    ours = GraphDecoder(copy.deepcopy(model), compile=False, attention="triton").generate(input_ids, mask, **kwargs)
    assert torch.equal(ours, sdpa)
    steps = len(op_calls) // model.config.num_hidden_layers  # every decode step of every layer, none on SDPA
    assert steps >= 1 and len(op_calls) == steps * model.config.num_hidden_layers


def test_graph_decoder_reads_each_prompt_once_for_its_samples(tiny, op_calls):  # noqa: F811
    """GRPO's rows: 3 prompts x 3 samples, as consecutive runs. The Triton loop told `samples=3` reads each prompt's
    part of the cache once a run (`shared_prefix`) and decodes what SDPA decodes; rows that are not runs of one
    prompt share nothing. Greedy, a run's rows stay equal, so the tokens alone would not show a shared read that
    reached past the prompt: what every kernel call was given does (the kernel cases above check the shared read
    where rows differ past the prefix)."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    kwargs = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "pad_id": pad_id, "eos_ids": eos_ids,
              "generator": None}
    ids, m = input_ids[:3].repeat_interleave(3, 0), mask[:3].repeat_interleave(3, 0)
    sdpa = GraphDecoder(copy.deepcopy(model), compile=False, attention="sdpa")
    expected = sdpa.generate(ids, m, samples=3, **kwargs)
    assert sdpa.shared_prefix == (1, 0)  # SDPA reads every row's cache whatever it is told
    ours = GraphDecoder(copy.deepcopy(model), compile=False, attention="triton")
    assert torch.equal(ours.generate(ids, m, samples=3, **kwargs), expected)
    assert ours.shared_prefix == (3, ids.shape[1])
    layers, width = model.config.num_hidden_layers, ids.shape[1]
    assert len(op_calls) >= layers and {call[1:] for call in op_calls} == {(3, width)}  # every step's, every layer's
    mixed = [0, 1, 3, 2, 4, 5, 6, 7, 8]  # the first run holds two prompts
    op_calls.clear()
    ours.generate(ids[mixed], m[mixed], samples=3, **kwargs)
    assert ours.shared_prefix == (1, 0) and {call[1:] for call in op_calls} == {(1, 0)}


def test_an_unknown_attention_is_refused(tiny):  # noqa: F811
    with pytest.raises(ValueError, match="sdpa, triton"):
        use_gqa_decode_attention(copy.deepcopy(tiny[0]), "flash")


def test_rollout_pads_every_batch_to_one_width_with_the_triton_attention(tiny):  # noqa: F811
    """With the Triton attention, which skips left padding, a compiled replica pads every batch to one width
    (`one_prompt_width`): batches of different widths share one cache (on a GPU, one recording of the decode step),
    and the responses are those of the same loop without the extra padding. On a CPU the loop is eager and the
    width is not set by itself (`test_rollout`), so it is set here."""
    model, pad_id, eos_ids, input_ids, mask = tiny
    common = {"pad_id": pad_id, "eos_ids": eos_ids, "max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0,
              "static_cache": False, "device": torch.device("cpu"), "cuda_graph": True, "decode_attention": "triton"}
    fixed = HFRollout(copy.deepcopy(model), prompt_width=100, **common)
    plain = HFRollout(copy.deepcopy(model), **common)
    assert fixed.prompt_width is None  # an eager loop records nothing: no padding for it
    fixed.prompt_width = 128
    wide_ids = torch.cat([input_ids.new_full((input_ids.shape[0], 9), pad_id), input_ids], dim=1)
    wide_mask = torch.cat([mask.new_zeros((mask.shape[0], 9)), mask], dim=1)
    assert wide_ids.shape[1] < 128
    for ids, m in ((input_ids, mask), (wide_ids, wide_mask)):
        out = fixed.generate(ids, m, seed=0)
        assert fixed.graph._cache_slot[0][:2] == (ids.shape[0], 128 + 5)  # one cache for both widths
        assert torch.equal(out["responses"], plain.generate(ids, m, seed=0)["responses"])
        assert plain.graph._cache_slot[0][:2] == (ids.shape[0], ids.shape[1] + 5)
