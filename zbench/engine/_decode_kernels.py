"""The Triton kernels of `zbench.engine.decode_attention`, in a module of their own: Triton decides when a kernel is
defined whether it compiles it or runs it in its interpreter (`TRITON_INTERPRET=1`), so importing this module late,
at the first call, lets a CPU test choose the interpreter."""

import triton
import triton.language as tl


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
             sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
             start, stop, chunk, first_split, scale,
             GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
             BLOCK: tl.constexpr, SPLITS: tl.constexpr, HEADS: tl.constexpr, STAGES: tl.constexpr,
             TRIM: tl.constexpr, SCAN: tl.constexpr, SHARE: tl.constexpr, DENSE: tl.constexpr,
             PDL: tl.constexpr = False):
    if PDL:  # launched before the kernel it follows has finished: wait for it before reading anything
        tl.extra.cuda.gdc_wait()
    # one program per (run of SHARE rows, key/value head, slice of the positions start..stop-1)
    _slice(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
           sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
           tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), start, stop, chunk, first_split, scale,
           SHARE, GROUP, GROUP_P2, ROWS, DIM, BLOCK, SPLITS, HEADS, STAGES, TRIM, SCAN, DENSE)


@triton.jit
def _partials(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
              sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
              batch, programs0, start0, stop0, chunk0, share0, start1, stop1, chunk1, share1, first1, scale,
              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
              BLOCK: tl.constexpr, SPLITS: tl.constexpr, HEADS: tl.constexpr, STAGES: tl.constexpr,
              TRIM: tl.constexpr, SCAN: tl.constexpr, DENSE: tl.constexpr, PDL: tl.constexpr = False):
    # `_partial`'s programs of a call's two ranges in one grid (`ONE_GRID`): program_id(0) counts range 0's (runs
    # fastest, then slices), then range 1's; the range's run length (`share`) is a value here, not a constant, so one
    # copy of the loop serves both, with the larger of the two ranges' tiles (ROWS) and mask scans (SCAN)
    if PDL:
        tl.extra.cuda.gdc_wait()
    p = tl.program_id(0)
    second = p >= programs0
    share = tl.where(second, share1, share0)
    at = tl.where(second, p - programs0, p)
    runs = batch // share
    _slice(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
           sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
           (at % runs).to(tl.int64), tl.program_id(1), at // runs, tl.where(second, start1, start0),
           tl.where(second, stop1, stop0), tl.where(second, chunk1, chunk0), tl.where(second, first1, 0), scale,
           share, GROUP, GROUP_P2, ROWS, DIM, BLOCK, SPLITS, HEADS, STAGES, TRIM, SCAN, DENSE)


@triton.jit
def _slice(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
           sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
           run, h, s, start, stop, chunk, first_split, scale, share,
           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
           BLOCK: tl.constexpr, SPLITS: tl.constexpr, HEADS: tl.constexpr, STAGES: tl.constexpr,
           TRIM: tl.constexpr, SCAN: tl.constexpr, DENSE: tl.constexpr):
    # run `run` (int64: a row's offset into a large cache passes 2**31 elements) of `share` rows, key/value head h,
    # slice s of the positions start..stop-1: the run's rows hold the same keys, values and mask there, so the
    # program reads them once, from the run's first row, for all of its rows' queries (1: every row on its own).
    # `share` is `_partial`'s constant (compiled in) or `_partials`' value
    b = run * share  # the row whose keys, values and mask the program reads
    # the rows of a tensor-core tile (tl.dot needs 16): the group's query heads of each row of the run, GROUP_P2
    # tile rows a row
    r = tl.arange(0, ROWS)
    row = b + r // GROUP_P2
    g = r % GROUP_P2
    d = tl.arange(0, DIM)
    ours = (r // GROUP_P2 < share) & (g < GROUP)
    q = tl.load(q_ptr + row[:, None] * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=ours[:, None],
                other=0.0)
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    lo = start + s * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, stop), lo)  # a trailing slice past the range is empty: hi == lo
    if TRIM:
        # the slice's first and last kept positions, from its mask bytes alone (SCAN at a time, one load for a
        # slice of SCAN or fewer): the loop below runs only over the blocks between them, so left padding and the
        # cache's unwritten tail cost no iterations (positions masked off between them are skipped by `keep`)
        first = hi
        last = lo - 1
        count = 0
        for at in range(lo, hi, SCAN):
            n = at + tl.arange(0, SCAN)
            inside = n < hi
            kept = inside & (tl.load(mask_ptr + b * sm_b + n * sm_n, mask=inside, other=0) != 0)
            first = tl.minimum(first, tl.min(tl.where(kept, n, hi), 0))
            last = tl.maximum(last, tl.max(tl.where(kept, n, lo - 1), 0))
            count += tl.sum(kept.to(tl.int32), 0)
        lo = lo + (first - lo) // BLOCK * BLOCK  # block-aligned; at or past the new `hi` when nothing is kept
        hi = last + 1
    if TRIM and DENSE:
        # where every position from the first kept to the last is kept (left padding, then a prompt and what was
        # generated: the decode loop's mask), the loop reads no mask: `keep` is the range alone, so the key and
        # value loads wait on no other load
        if count == hi - first:
            acc, run_max, run_sum = _range_loop(q, k_ptr, v_ptr, b, h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, lo, hi,
                                                first, scale, acc, run_max, run_sum, d, BLOCK, STAGES)
        else:
            acc, run_max, run_sum = _mask_loop(q, k_ptr, v_ptr, mask_ptr, b, h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                                               sm_b, sm_n, lo, hi, scale, acc, run_max, run_sum, d, BLOCK, STAGES)
    else:
        acc, run_max, run_sum = _mask_loop(q, k_ptr, v_ptr, mask_ptr, b, h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                                           sm_b, sm_n, lo, hi, scale, acc, run_max, run_sum, d, BLOCK, STAGES)
    # each row's own tile rows (GROUP_P2 of them, the padding's zeros past GROUP) go to the combine, at its slice
    slot = ((row * HEADS + h) * SPLITS + first_split + s) * GROUP_P2 + g
    kept_rows = r // GROUP_P2 < share
    tl.store(acc_ptr + slot[:, None] * DIM + d[None, :], acc, mask=kept_rows[:, None])
    tl.store(max_ptr + slot, run_max, mask=kept_rows)
    tl.store(sum_ptr + slot, run_sum, mask=kept_rows)


@triton.jit
def _step(q, k, v, keep, scale, acc, run_max, run_sum):
    # one block of positions into the running max, normaliser and weighted sum; float32 caches multiply in float32,
    # not TF32 (bf16 ones are unaffected)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (ROWS, BLOCK), float32
    scores = tl.where(keep[None, :], scores, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(scores, 1))
    base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no kept position yet: nothing to rescale
    p = tl.exp(scores - base[:, None])
    rescale = tl.exp(run_max - base)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, new_max, run_sum * rescale + tl.sum(p, 1)


@triton.jit
def _mask_loop(q, k_ptr, v_ptr, mask_ptr, b, h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n, lo, hi, scale,
               acc, run_max, run_sum, d, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    # the blocks lo..hi-1, a position read where the row's mask keeps it
    for at in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        n = at + tl.arange(0, BLOCK)
        inside = n < hi
        keep = inside & (tl.load(mask_ptr + b * sm_b + n * sm_n, mask=inside, other=0) != 0)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_n + d[None, :], mask=keep[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_n + d[None, :], mask=keep[:, None], other=0.0)
        acc, run_max, run_sum = _step(q, k, v, keep, scale, acc, run_max, run_sum)
    return acc, run_max, run_sum


@triton.jit
def _range_loop(q, k_ptr, v_ptr, b, h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, lo, hi, first, scale, acc, run_max,
                run_sum, d, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    # the blocks lo..hi-1 where every position from `first` to hi-1 is kept: no mask to read
    for at in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        n = at + tl.arange(0, BLOCK)
        keep = (n >= first) & (n < hi)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_n + d[None, :], mask=keep[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_n + d[None, :], mask=keep[:, None], other=0.0)
        acc, run_max, run_sum = _step(q, k, v, keep, scale, acc, run_max, run_sum)
    return acc, run_max, run_sum


@triton.jit
def _combine(acc_ptr, max_ptr, sum_ptr, out_ptr, so_b, so_h, so_g, used,
             GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr,
             HEADS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_wait()
    # the first `used` of SPLITS slices were written (SPLITS: a power of 2, for the tile); the rest weigh nothing
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM)
    slot = ((b * HEADS + h) * SPLITS + s[:, None]) * GROUP_P2 + g[None, :]  # (SPLITS, GROUP_P2)
    written = (s < used)[:, None]
    maxes = tl.load(max_ptr + slot, mask=written, other=float("-inf"))
    top = tl.max(maxes, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(maxes - top[None, :])  # a slice with no kept position weighs 0
    total = tl.sum(weight * tl.load(sum_ptr + slot, mask=written, other=0.0), 0)
    parts = tl.load(acc_ptr + slot[:, :, None] * DIM + d[None, None, :], mask=written[:, :, None],
                    other=0.0)  # (SPLITS, GROUP_P2, DIM)
    out = tl.sum(parts * weight[:, :, None], 0) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g[:, None] < GROUP)
