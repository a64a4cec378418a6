"""The Triton kernel of `zbench.engine.race_sampling`, in a module of its own: Triton decides when a kernel is defined
whether it compiles it or runs it in its interpreter (`TRITON_INTERPRET=1`), so importing this module late, at the
first call, lets a CPU test choose the interpreter."""

import triton
import triton.language as tl


@triton.jit
def _exponential(r):
    """An Exp(1) draw from 32 random bits: -log(1 - v), v the bits' midpoint in (0, 1). 1 - v is taken from the
    complemented bits, so it never rounds to 0 (where the largest bits would rule their column out); below v = 2**-10
    a series, where 1 - v would round away the bits that separate the smallest draws (which win the race)."""
    v = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    rest = ((~r).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - v
    small = v * (1.0 + v * (0.5 + v * 0.3333333333333333))
    return tl.where(v < 0.0009765625, small, -tl.log(rest))


@triton.jit
def _better(best_v, best_i, logits_ptr, cols, vocab, inv_t, r):
    """Each lane's best (score, column) after the columns `cols`: score = logit / T - log E, E ~ Exp(1)."""
    x = tl.load(logits_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    score = x * inv_t - tl.log(_exponential(r))
    take = score > best_v
    return tl.where(take, score, best_v), tl.where(take, cols, best_i)


@triton.jit
def _race(logits_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr, stride_row, vocab, rows, inv_t, chunk,
          QUARTER: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    seed = tl.load(seed_ptr)
    step = tl.load(step_ptr)
    lane = tl.arange(0, QUARTER)
    groups = tl.cdiv(vocab, 4 * QUARTER) * QUARTER  # four columns a Philox counter
    base_counter = (step * rows + row) * groups
    logits_ptr += row * stride_row
    best_v = tl.full([QUARTER], float("-inf"), tl.float32)
    best_i = tl.zeros([QUARTER], tl.int64)
    lo = split * chunk
    for start in range(lo, lo + chunk, 4 * QUARTER):
        r0, r1, r2, r3 = tl.randint4x(seed, base_counter + start // 4 + lane)
        cols = start + lane
        best_v, best_i = _better(best_v, best_i, logits_ptr, cols, vocab, inv_t, r0)
        best_v, best_i = _better(best_v, best_i, logits_ptr, cols + QUARTER, vocab, inv_t, r1)
        best_v, best_i = _better(best_v, best_i, logits_ptr, cols + 2 * QUARTER, vocab, inv_t, r2)
        best_v, best_i = _better(best_v, best_i, logits_ptr, cols + 3 * QUARTER, vocab, inv_t, r3)
    top = tl.max(best_v, axis=0)
    # the lowest column among the lanes at the top (a lane whose columns were all -inf keeps column 0)
    at_top = tl.where(best_v == top, best_i, vocab)
    tl.store(val_ptr + row * SPLITS + split, top)
    tl.store(idx_ptr + row * SPLITS + split, tl.min(at_top, axis=0))
