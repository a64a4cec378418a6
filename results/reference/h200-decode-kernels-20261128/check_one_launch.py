"""The one-launch decode attention (`ONE_LAUNCH`) checked on a GPU, one JSON line a check: against the launches
it replaces (bitwise) and SDPA (float32) across plans (one range, a shared prefix, the ranges in reverse order so
shared-prefix programs merge, many slices, sub-runs, float32, a 20,000-position cache); 28 calls captured in a CUDA
graph and replayed, every replay equal to the first; the counts back at zero; a capture with no counts allocated
falling back to the launches; and under torch.compile's CUDA graphs across batch shapes that allocate new counts
during the recording's warm-up. From the project root (`kernels.sh` runs it with CHECK set):
    PYTHONPATH=. python3 results/reference/h200-decode-kernels-20261128/check_one_launch.py
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

import zbench.engine.decode_attention as da

dev = torch.device("cuda")
T0 = time.time()


def log(**kw):
    print(json.dumps({"t": round(time.time() - T0, 1)} | kw), flush=True)


def make(batch, share, prefix, length, group=2, kv=8, dim=128, dtype=torch.bfloat16, nowhere=True, seed=0):
    g = torch.Generator(dev).manual_seed(seed)
    q = torch.randn(batch, kv, group, dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(batch, kv, length, dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn(batch, kv, length, dim, device=dev, dtype=dtype, generator=g)
    rows = torch.arange(batch, device=dev)
    pos = torch.arange(length, device=dev)
    pad = (rows // share * 13) % (max(prefix, 2) // 2)
    end = prefix + 1 + (rows * 37) % (length - prefix)
    mask = (pos >= pad[:, None]) & (pos < end[:, None])
    mask[1::3, prefix + 5: prefix + 200: 7] = False
    if share > 1:
        for t in (k, v):
            t[:, :, :prefix] = t[::share, :, :prefix].repeat_interleave(share, 0)
    elif nowhere:
        mask[2] = False
    return q, k, v, mask


def ref(q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :], scale=scale)
    return out.masked_fill(~mask.any(1)[:, None, None, None], 0.0)


def call(one, q, k, v, mask, share, prefix):
    da.ONE_LAUNCH = one
    return da.decode_attention(q, k, v, mask, q.shape[-1] ** -0.5, share, prefix)


def check(name, batch, share, prefix, length, chunk=8, reverse=False, replays=200, **kw):
    da.CHUNK_BLOCKS = chunk
    planned = da.plan
    if reverse:
        da.plan = lambda *a: planned(*a)[::-1]
    try:
        q, k, v, mask = make(batch, share, prefix, length, **kw)
        exact = ref(q, k, v, mask, q.shape[-1] ** -0.5)
        old = call(False, q, k, v, mask, share, prefix)
        new = call(True, q, k, v, mask, share, prefix)
        again = call(True, q, k, v, mask, share, prefix)
        counts = da._COUNTERS[q.device][-1]
        res = {"name": name, "plan": da.plan(length, 2 if q.shape[2] == 2 else q.shape[2], share, prefix),
               "bitwise_old": torch.equal(old, new), "max_diff_old": (old.float() - new.float()).abs().max().item(),
               "err_new": (new.float() - exact).abs().max().item(), "err_old": (old.float() - exact).abs().max().item(),
               "again_equal": torch.equal(again, new), "counts_zero": not counts.any().item()}
        # a CUDA graph of 28 calls replayed: every replay's outputs equal the first's, counts zero after
        da.ONE_LAUNCH = True
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(True, q, k, v, mask, share, prefix)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call(True, q, k, v, mask, share, prefix) for _ in range(28)]
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        for _ in range(replays):
            graph.replay()
            for o in outs:
                bad += (o != new).any()
        torch.cuda.synchronize()
        res |= {"replay_mismatches": bad.item(), "counts_zero_after_replays": not counts.any().item(),
                "counters": [c.numel() for c in da._COUNTERS[q.device]]}
        log(**res)
    finally:
        da.plan = planned
        da.CHUNK_BLOCKS = 8


try:
    check("b32 share1", 32, 1, 0, 704)
    check("b128 share1", 128, 1, 0, 704)
    check("b32 share4 prefix192", 32, 4, 192, 704)
    check("b128 share4 prefix192", 128, 4, 192, 704)
    check("b128 share4 prefix192 reversed", 128, 4, 192, 704, reverse=True)
    check("b8 share1 chunk1 (many splits)", 8, 1, 0, 704, chunk=1)
    check("b16 share4 chunk1 prefix192", 16, 4, 192, 704, chunk=1)
    check("b16 share16 group4 subruns", 16, 16, 100, 704, chunk=1, group=4, kv=4)
    check("b8 share4 fp32 dim64", 8, 4, 192, 704, chunk=2, dtype=torch.float32, dim=64)
    check("b4 share2 long 20000", 4, 2, 3000, 20000, kv=2, replays=20)
except Exception as exc:
    log(error=repr(exc)[:2000])

# a capture with no counts allocated yet: the launches of ONE_LAUNCH False, none allocated
try:
    key = torch.device("cuda", 0)
    saved = da._COUNTERS.pop(key)
    q, k, v, mask = make(32, 1, 0, 704)
    eager = call(False, q, k, v, mask, 1, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(True, q, k, v, mask, 1, 0)
    graph.replay()
    torch.cuda.synchronize()
    log(name="capture fallback", equal=torch.equal(out, eager), allocated=len(da._COUNTERS.get(key, [])))
    da._COUNTERS[key] = saved
except Exception:
    import traceback
    log(error=traceback.format_exc()[-3000:])

# torch.compile with CUDA graphs (cudagraph trees, as GraphDecoder): the counts of a larger call are allocated
# during the recording's warm-up; then a smaller shape and back
try:
    da.ONE_LAUNCH, da.CHUNK_BLOCKS = True, 8
    before = len(da._COUNTERS[torch.device("cuda", 0)])

    def step(q, k, v, mask):
        return da.decode_attention(q, k, v, mask, 128 ** -0.5, 4, 192) * 2

    compiled = torch.compile(step, mode="reduce-overhead", dynamic=False)
    shapes = [512, 64, 512, 64, 1024]
    worst = 0.0
    for batch in shapes:
        q, k, v, mask = make(batch, 4, 192, 704, seed=batch)
        expected = step(q, k, v, mask).clone()
        for _ in range(4):
            got = compiled(q, k, v, mask).clone()
            worst = max(worst, (got.float() - expected.float()).abs().max().item())
        junk = [torch.randn(1 << 20, device=dev) for _ in range(8)]  # allocations that could land on freed blocks
        del junk
    cs = da._COUNTERS[torch.device("cuda", 0)]
    log(name="torch.compile reduce-overhead", worst_diff_vs_eager=worst, counters=[c.numel() for c in cs],
        counts_zero=all(not c.any().item() for c in cs), new_buffers=len(cs) - before)
except Exception:
    import traceback
    log(error=traceback.format_exc()[-3000:])
sys.exit(0)
