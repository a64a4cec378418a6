"""The decode step's matrix multiplies alone, on one GPU: cuBLAS (what `torch.nn.functional.linear` runs in the
recorded step) against a Triton kernel shaped for few rows, for each kernel geometry asked.

At GRPO's 128 rows a GPU, the graph loop's four layer multiplies (merged q/k/v, o, merged gate/up, down) read 31 MB
of weights a layer and token, and took 23 µs on an H200, where the 3 TB/s its decode attention reaches would read
them in about 10 (results/reference/h200x2-dense-20261128). cuBLAS tiles few rows into few programs. The kernel here
gives every program `--block-n` output columns and all the rows, so a narrow tile spreads the weights over every SM;
where N is small it also splits K (`--split-k`), each slice's partial sums added by a second pass, in a fixed order
(the rollout samples seed for seed, so no atomics). Nothing here is used by the engine: it measured whether such a
kernel was worth building into the rollout replica, and on an H200 at 128 rows cuBLAS was faster on every shape than
every geometry that ran there (528 of 864; results/reference/h200-decode-kernels-20261128), so the engine keeps cuBLAS.

Each variant is captured as a CUDA graph of `--layers` calls and replayed, as in the decode step, so launch overhead
counts as it does there. One JSON line per measurement, with the largest difference from cuBLAS's result:

    python benchmarks/decode_gemm_bench.py --rows 128
    python benchmarks/decode_gemm_bench.py --rows 32 128 --block-n 32 64 --split-k 1 2
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from decode_attention_bench import graph_time  # this script's folder
from triton.runtime.errors import OutOfResources

# (name, N, K) of Qwen3-0.6B's layer multiplies as the rollout replica merges them
SHAPES = (("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072))


@triton.jit
def _skinny(x_ptr, w_ptr, out_ptr, M, N, sx_m, sw_n, so_s, so_m, k_per_split,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # one program per (BLOCK_N output columns, slice of K): every row against the slice's weights, summed in float32
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lo = split * k_per_split
    for k in tl.range(lo, lo + k_per_split, BLOCK_K, num_stages=STAGES):
        a = tl.load(x_ptr + m[:, None] * sx_m + (k + kk)[None, :], mask=m[:, None] < M, other=0.0)
        b = tl.load(w_ptr + n[:, None] * sw_n + (k + kk)[None, :], mask=n[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(out_ptr + split * so_s + m[:, None] * so_m + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, split_k: int, stages: int,
                  warps: int) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T in x's dtype; K must divide into `split_k` slices of whole `block_k` blocks."""
    rows, depth = x.shape
    cols = w.shape[0]
    if depth % (split_k * block_k):
        raise ValueError(f"K={depth} does not split into {split_k} slices of {block_k}")
    out = torch.empty((split_k, rows, cols), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    _skinny[(triton.cdiv(cols, block_n), split_k)](
        x, w, out, rows, cols, x.stride(0), w.stride(0), out.stride(0), out.stride(1), depth // split_k,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        num_warps=warps)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[128], help="rows a GPU decodes (GRPO 128, PPO 32)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--split-k", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    args = parser.parse_args()

    for rows, (name, cols, depth) in itertools.product(args.rows, SHAPES):
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(cols, depth, device="cuda", dtype=torch.bfloat16, generator=g) * depth ** -0.5
        reference = F.linear(x, w)
        base = {"rows": rows, "shape": name, "n": cols, "k": depth, "weight_mb": cols * depth * 2 / 1e6}  # MB/µs: TB/s
        us = graph_time(functools.partial(F.linear, x, w), args.layers, args.repeats)
        print(json.dumps(base | {"variant": "cublas", "us_per_call": us, "tb_per_s": base["weight_mb"] / us}),
              flush=True)
        for block_n, block_k, split_k, stages, warps in itertools.product(args.block_n, args.block_k, args.split_k,
                                                                         args.stages, args.warps):
            if depth % (split_k * block_k):
                continue
            variant = base | {"variant": "triton", "block_n": block_n, "block_k": block_k, "split_k": split_k,
                              "stages": stages, "warps": warps}
            call = functools.partial(skinny_linear, x, w, block_n, block_k, split_k, stages, warps)
            try:  # a geometry can exceed the GPU's shared memory or registers: say so and go on
                error = (call().float() - reference.float()).abs().max().item()
                us = graph_time(call, args.layers, args.repeats)
            except (OutOfResources, RuntimeError) as exc:
                print(json.dumps(variant | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}), flush=True)
                continue
            print(json.dumps(variant | {"us_per_call": us, "tb_per_s": base["weight_mb"] / us, "max_abs_error": error}),
                  flush=True)


if __name__ == "__main__":
    main()
