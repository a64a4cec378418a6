"""The decode step's attention alone, on one GPU: SDPA over the whole static cache (what `GraphDecoder` runs with
`attention="sdpa"`) against `zbench.engine.decode_attention`'s Triton kernels, which read only the masked-in
positions, for each kernel geometry asked. Each variant is captured as a CUDA graph of one call per layer and
replayed, as in the decode step, so launch overhead counts as it does there.

The mask is a rollout's midpoint: half the rows left-padded by `--pad` positions, every row filled to
`--width + --filled` of `--width + --new-tokens`. With `--share n` (several: each in turn) the rows come as runs of n
samples of one prompt, equal over the prompt's `--width` positions, and the kernels read that part once a run
(`decode_attention`'s `share` and `prefix`). One JSON line per measurement:

    python benchmarks/decode_attention_bench.py --batch 32 128 --width 192 --new-tokens 512 --filled 256
    python benchmarks/decode_attention_bench.py --batch 128 --width 512 --pad 337 --share 1 4 --block 64 \
        --chunk-blocks 4 --warps 4 --stages 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

import zbench.engine.decode_attention as da


def on_off(parser: argparse.ArgumentParser, flag: str, default: str, help: str) -> None:
    """A switch of the code measured, `on` and/or `off`, each value given measured in turn."""
    parser.add_argument(flag, nargs="+", default=[default], choices=("on", "off"), help=help)


def graph_time(fn, layers: int, repeats: int) -> float:
    """Microseconds per call of `fn`, captured `layers` times into one CUDA graph and replayed `repeats` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (repeats * layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--filled", type=int, default=256, help="generated positions already in the cache")
    parser.add_argument("--pad", type=int, default=48, help="left padding of half the rows")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--block", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--chunk-blocks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--share", type=int, nargs="+", default=[1],
                        help="rows a run that read their prompt's positions once (1: every row its own)")
    on_off(parser, "--trim", "on", "each program loops only between its slice's first and last kept positions "
           "(on, the default), or over the whole slice")
    on_off(parser, "--dense", "on", "with the trim: a slice kept everywhere between its first and last kept "
           "positions loops without reading the mask (on, the default), or reads it every block (off)")
    on_off(parser, "--one-grid", "on", "with --share above 1: the prefix's and the rows' own programs in one launch "
           "(`ONE_GRID`, the default), or a launch each (off)")
    on_off(parser, "--pdl", "on", "programmatic dependent launch (`PDL`, the default): each kernel scheduled while "
           "the one before it drains (Hopper and later)")
    args = parser.parse_args()

    length = args.width + args.new_tokens
    group = args.heads // args.kv_heads
    scale = args.dim ** -0.5
    for batch in args.batch:
        g = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(batch, args.kv_heads, group, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, args.kv_heads, length, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        mask = torch.zeros(batch, length, dtype=torch.bool, device="cuda")
        mask[:, : args.width + args.filled] = True
        mask[: batch // 2, : args.pad] = False

        @functools.cache
        def runs_of(share: int, k: torch.Tensor = k, v: torch.Tensor = v, mask: torch.Tensor = mask,
                    q: torch.Tensor = q) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
            """The cache and mask with rows in runs of `share` equal over the prompt's columns (each run's first
            row's), as GRPO's samples of one prompt hold them (as they are for 1), and SDPA's float32 result on them."""
            if share > 1:
                k, v, mask = k.clone(), v.clone(), mask.clone()
                for part in (k, v, mask[:, None, :, None]):
                    part[:, :, : args.width] = part[::share, :, : args.width].repeat_interleave(share, 0)
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :],
                                                   scale=scale)
            return (k, v, mask), exact

        base = {"batch": batch, "length": length, "attended": mask.float().mean().item(), "layers": args.layers}
        sdpa_us = graph_time(functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask[:, None, None, :],
                                               scale=scale), args.layers, args.repeats)
        print(json.dumps(base | {"variant": "sdpa", "us_per_call": sdpa_us}), flush=True)
        for block, chunk, warps, stages, trim, share, dense, one_grid, pdl in itertools.product(
                args.block, args.chunk_blocks, args.warps, args.stages, args.trim, args.share, args.dense,
                args.one_grid, args.pdl):
            if batch % share:
                print(json.dumps(base | {"variant": "triton", "share": share,
                                         "skipped": f"runs of {share} rows do not divide {batch} rows"}), flush=True)
                continue
            if share == 1 and one_grid != args.one_grid[0]:  # one range: nothing for ONE_GRID to join, one run
                continue
            da.BLOCK_N, da.CHUNK_BLOCKS, da.NUM_WARPS, da.STAGES, da.TRIM = block, chunk, warps, stages, trim == "on"
            da.DENSE, da.ONE_GRID, da.PDL = dense == "on", one_grid == "on", pdl == "on"
            variant = base | {"variant": "triton", "block": block, "chunk_blocks": chunk, "warps": warps,
                              "stages": stages, "trim": trim, "share": share, "dense": dense,
                              "one_grid": one_grid if share > 1 else None,
                              "pdl": pdl, "pdl_in_effect": da.pdl_applies(q.device),
                              "splits": sum(cut[3] for cut in da.plan(length, da.triton.next_power_of_2(group), share,
                                                                       args.width if share > 1 else 0))}
            cache, reference = runs_of(share)
            call = functools.partial(da.decode_attention, q, *cache, scale, share, args.width if share > 1 else 0)
            try:  # a geometry can exceed the GPU's shared memory: say so and go on with the sweep
                error = (call().float() - reference).abs().max().item()
                us = graph_time(call, args.layers, args.repeats)
            except (OutOfResources, RuntimeError) as exc:
                print(json.dumps(variant | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}), flush=True)
                continue
            print(json.dumps(variant | {"us_per_call": us, "max_abs_error": error}), flush=True)


if __name__ == "__main__":
    main()
