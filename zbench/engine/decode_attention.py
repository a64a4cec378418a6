"""One-token attention over a static KV cache that reads only the cache positions the mask lets a row attend.

`GraphDecoder`'s cache is as wide as the prompt bucket plus every token still to come, and SDPA reads all of it on
every decode step, masked or not: at 32 rows, 192 + 512 positions, that was 0.61 s of a 1.52 s rollout's kernels on
an H100 (results/reference/h100-gpu-share-20261127), where the positions a row attends average about 60 % of the
width. These Triton kernels read a key or value only where the row's mask is set (a masked-off load moves no
data), so left padding and the cache's unwritten tail cost nothing but the mask bytes.

Split-K ("flash decoding"): `_partial` runs one program per (row, key/value head, split) over a slice of the cache
(per run of rows over a shared prefix, below), with the query heads that share the key/value head as the rows of its
tile (grouped-query attention reads each key once). It first reads its slice's mask bytes for the first and last kept positions and loops only over the blocks
between them, so a slice of padding or unwritten cache costs one mask load, not an iteration per block (`TRIM`;
it takes 18 % off the kernel's time at 32 and 128 rows on an H200,
results/reference/h200x2-merged-projections-20261127).
It keeps the running max, normaliser and weighted sum of its slice in float32; `_combine` rescales the slices
to their common max and adds them up. Both launch with a fixed grid and no host sync, so they are recorded into the
decode step's CUDA graph like any kernel; `torch.compile` sees them as one opaque operator (`zbench::decode_attention`).

A shared prefix: GRPO samples each prompt n times, and the n rows of a prompt hold the same keys and values over the
prompt's columns (`GraphDecoder._prefill` writes one computation into all of them). With `share=n, prefix=width`
the prompt's columns are read by one program per run of n rows, whose tile holds the queries of all n rows, and
only the columns past the prompt by one program a row; the combine merges both kinds of slice. A run whose queries
would not fit one tile (`MAX_SHARED_QUERIES`) is read in sub-runs that do. At 128 rows of 32
prompts x 4, whose prompts average 175 tokens against 256 of response on average, that reads about 30 % fewer bytes.

Triton ships with PyTorch's CUDA builds; without it (a CPU-only install) `available()` is False and the caller keeps
SDPA. On a CPU, `TRITON_INTERPRET=1` runs the same kernels in Triton's interpreter, which is how they are tested
against SDPA (the kernels' module is imported at the first call, so the variable need only be set before that).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
except ImportError:  # a CPU-only install: the caller keeps SDPA
    triton = None

BLOCK_N = 64  # cache positions per loop iteration
# loop iterations per program, at most: the cache splits into slices of this many blocks. 8 against 4: 8-9 % less
# time at 32 and 128 rows, and 7 % with a shared prefix, on an H200 (results/reference/shared-prefix-20261128)
CHUNK_BLOCKS = 8
MAX_SPLITS = 16
NUM_WARPS = 4
STAGES = 3  # software pipelining of the cache loads
TRIM = True  # each program first finds its slice's first and last kept positions and loops only between them
# with TRIM: a slice kept everywhere between its first and last kept positions (the decode loop's rows) loops without
# reading the mask, so its key and value loads wait on no other load; a slice with holes reads it every block
# (`benchmarks/decode_attention_bench.py --dense on off` and `graph_decode_profile.py --dense on off` compare)
DENSE = True
# programmatic dependent launch (CUDA, Hopper and later; elsewhere ignored, `pdl_applies`): each kernel may be
# scheduled while the kernel before it drains, and waits for it before reading or writing anything, which hides part
# of the gap between kernels in a recorded step. A wait covers the kernel just before, so a chain holds only where
# every kernel in it waits: the graph loop compiles Inductor's kernels with `triton.enable_pdl` too, which wait before
# what they load (`zbench.engine.rollout.GraphDecoder`). None signals its dependents early (`gdc_launch_dependents`).
# GRPO's rollout on an H200, 128 rows: 1.684 -> 1.651 s with ONE_GRID off, 1.610 -> 1.565 s with it on
# (results/reference/h200x2-pdl-20261128; `benchmarks/graph_decode_profile.py --pdl on off`)
PDL = True
# a shared prefix's programs and the rows' own in one `_partials` launch, not a `_partial` launch a range: one kernel
# fewer a call, and the prefix's few programs run beside the others instead of alone. Where the two ranges' tiles
# differ (runs of rows x query heads past 16), every program takes the larger. On an H200, runs of 4 at 128 rows:
# 36.2 -> 33.6 us a call at 64 generated positions, 82.9 -> 77.2 at 448; GRPO's rollout 1.684 -> 1.610 s
# (results/reference/h200x2-pdl-20261128; `benchmarks/decode_attention_bench.py --one-grid on off`)
ONE_GRID = True
# rows of a shared-prefix program's tile at most: a run's rows x their query heads a key/value head (rounded up to a
# power of 2); a longer run is read in sub-runs that fit (tiles of 16 rows measured on an H100 and H200, not more)
MAX_SHARED_QUERIES = 32


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: Triton is importable and the device is CUDA, or Triton's
    interpreter is on (`TRITON_INTERPRET`), which runs them, slowly, on CPU tensors."""
    if triton is None:
        return False
    return device.type == "cuda" or _interpreting()


def pdl_applies(device: torch.device) -> bool:
    """Whether the kernels launch with programmatic dependent launch on `device`: `PDL` is on and it is a CUDA GPU
    of compute capability 9 (Hopper) or later."""
    if not PDL or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (read as Triton reads it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def supports(head_dim: int, value_dim: int | None = None, element_size: int = 2) -> bool:
    """Whether the kernels take heads of this size and precision: a power of 2 from 16 (a tile dimension), keys and
    values alike, up to 256 at 2 bytes an element and 128 at 4 (a float32 tile of 256 needs more shared memory than
    an H100 has). Other heads (80, 96: Phi-2, Phi-3) stay with SDPA."""
    largest = 256 if element_size <= 2 else 128
    return 16 <= head_dim <= largest and head_dim & (head_dim - 1) == 0 and value_dim in (None, head_dim)


def unsupported(config: Any, dtype: torch.dtype) -> str | None:
    """Why a transformers model config's attention cannot run on the kernels (None where it can): head sizes they
    do not take, or attention parts they do not compute, which would send every layer back to SDPA."""
    heads = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = {heads, getattr(config, "v_head_dim", None) or heads, getattr(config, "qk_head_dim", None) or heads}
    if len(sizes) > 1 or not supports(heads, element_size=torch.empty((), dtype=dtype).element_size()):
        return f"heads of {sorted(sizes)} dimensions in {str(dtype).replace('torch.', '')} (the kernels take one " \
               "size, a power of 2 from 16 to 256, 128 in float32)"
    if getattr(config, "attn_logit_softcapping", None):
        return "softcapped attention logits"
    if getattr(config, "model_type", "") == "gpt_oss":
        return "attention sinks"
    return None


def slices(length: int, most: int = 0) -> tuple[int, int]:
    """How `_partial` cuts `length` cache positions: (slices per (row, head), positions per slice). The slice
    count is a power of 2, enough for `CHUNK_BLOCKS` blocks a slice and `most` (default `MAX_SPLITS`) at most: many
    small programs keep many loads in flight, which a memory-bound kernel needs, and the combine loads every slice
    of a (row, head) as one tile. Each slice is whole blocks; trailing slices past the end are empty and weigh
    nothing in the combine."""
    splits = min(most or MAX_SPLITS, triton.next_power_of_2(triton.cdiv(length, CHUNK_BLOCKS * BLOCK_N)))
    return splits, triton.cdiv(triton.cdiv(length, splits), BLOCK_N) * BLOCK_N


@torch.library.custom_op("zbench::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float, share: int = 1, prefix: int = 0) -> torch.Tensor:
    """Attention of one query per (row, query head) over a key/value cache, positions where `mask` is False skipped.

    query (B, H_kv, G, D): the G query heads that share each key/value head; key, value (B, H_kv, L, D); mask (B, L),
    True where the row attends. Returns (B, H_kv, G, D) in the query's dtype; a row that attends nothing gets zeros.

    `share` > 1 says that each run of `share` consecutive rows holds the same keys, values and mask in its first
    `prefix` positions (GRPO's samples of one prompt: the prompt's part of the cache): one program reads them there
    once, from the run's first row, for the queries of all its rows; past `prefix` every row reads its own. Where
    the rows differ there, the first row's prefix is what all of them attend (the caller must know they agree).
    """
    from zbench.engine._decode_kernels import _combine, _partial, _partials

    _check(query, key, value, mask, share, prefix)
    batch, heads, group, dim = query.shape
    length = key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    group_p2 = triton.next_power_of_2(group)
    ranges = plan(length, group_p2, share, prefix)
    used = sum(splits for *_, splits, _ in ranges)
    splits_p2 = triton.next_power_of_2(used)
    stats = (batch, heads, splits_p2, group_p2)
    acc = torch.empty(*stats, dim, dtype=torch.float32, device=query.device)
    run_max = torch.empty(stats, dtype=torch.float32, device=query.device)
    run_sum = torch.empty(stats, dtype=torch.float32, device=query.device)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    mask = mask.view(torch.uint8)
    pdl = {"PDL": True, "launch_pdl": True} if pdl_applies(query.device) else {}
    inputs = (query, key, value, mask, acc, run_max, run_sum,
              query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
              value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(1))
    common = {"GROUP": group, "GROUP_P2": group_p2, "DIM": dim, "BLOCK": BLOCK_N, "SPLITS": splits_p2,
              "HEADS": heads, "STAGES": STAGES, "TRIM": TRIM, "DENSE": DENSE, "num_warps": NUM_WARPS, **pdl}

    def tile(rows: int, chunk: int) -> dict[str, int]:  # a program's tile rows and mask scan
        return {"ROWS": max(16, triton.next_power_of_2(rows * group_p2)),
                "SCAN": min(1024, triton.next_power_of_2(chunk))}

    if ONE_GRID and len(ranges) == 2:
        (begin0, stop0, rows0, splits0, chunk0), (begin1, stop1, rows1, splits1, chunk1) = ranges
        programs0 = batch // rows0 * splits0
        _partials[(programs0 + batch // rows1 * splits1, heads)](
            *inputs, batch, programs0, begin0, stop0, chunk0, rows0, begin1, stop1, chunk1, rows1, splits0, scale,
            **tile(max(rows0, rows1), max(chunk0, chunk1)), **common)
    else:
        first_split = 0
        for begin, stop, rows, splits, chunk in ranges:
            _partial[(batch // rows, heads, splits)](*inputs, begin, stop, chunk, first_split, scale,
                                                     **tile(rows, chunk), SHARE=rows, **common)
            first_split += splits
    _combine[(batch, heads)](acc, run_max, run_sum, out, out.stride(0), out.stride(1), out.stride(2), used,
                             GROUP=group, GROUP_P2=group_p2, DIM=dim, SPLITS=splits_p2, HEADS=heads, **pdl)
    return out


def plan(length: int, group_p2: int, share: int = 1, prefix: int = 0) -> list[tuple[int, int, int, int, int]]:
    """The ranges of one call, a `_partial` launch each (with `ONE_GRID`, both in one `_partials` launch): (first
    position, end, rows a program reads for, slices, positions per slice) of each, the shared prefix (if any)
    first. Both ranges together keep to MAX_SPLITS slices, as one range alone does."""
    share = tile_share(share, group_p2)
    prefix = prefix if share > 1 else 0
    spans = [(begin, stop, rows) for begin, stop, rows in ((0, prefix, share), (prefix, length, 1)) if stop > begin]
    return [(begin, stop, rows, *slices(stop - begin, MAX_SPLITS // len(spans))) for begin, stop, rows in spans]


def tile_share(share: int, group_p2: int) -> int:
    """The rows a shared-prefix program reads for: the largest divisor of `share` whose queries (rows x `group_p2`)
    fit a tile of `MAX_SHARED_QUERIES` rows. Any run of consecutive rows within a run of `share` holds its prefix."""
    return max(d for d in range(1, share + 1) if share % d == 0 and d * group_p2 <= max(MAX_SHARED_QUERIES, group_p2))


@decode_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
      share: int = 1, prefix: int = 0) -> Any:
    _check(query, key, value, mask, share, prefix)  # while tracing, not only at the first real call
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, as the real output


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, share: int,
           prefix: int) -> None:
    """Shapes, sizes and the mask the kernels read right; anything else would be read wrong, not refused."""
    batch, heads, _, dim = query.shape
    length = key.shape[2]
    if not supports(dim, value.shape[-1], query.element_size()) or key.shape != value.shape \
            or key.shape[:2] != (batch, heads) or key.shape[3] != dim:
        raise ValueError(f"decode_attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)} in {query.dtype}: needs (B, H_kv, G, D) against (B, H_kv, L, D), D a "
                         "power of 2 from 16 to 256 (128 in float32)")
    if mask.dtype != torch.bool or mask.shape != (batch, length):
        raise ValueError(f"decode_attention: the mask must be bool of shape {(batch, length)} (True: attend); got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if share < 1 or batch % share or not 0 <= prefix <= length:
        raise ValueError(f"decode_attention: share={share}, prefix={prefix} for {batch} rows of {length} positions: "
                         f"needs rows in whole runs of `share` and 0 <= prefix <= {length}")
