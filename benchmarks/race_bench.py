"""The decode step's draw alone (`zbench.engine.race_sampling.race`), on one GPU: one token per row from bf16 logits
over a 151,936-token vocabulary (Qwen3's), timed as a CUDA graph of `--calls` draws replayed, as in the recorded
step, for each kernel geometry asked: programs aimed at (`PROGRAMS`: how finely each row's vocabulary is sliced),
columns a lane block holds (`QUARTER`) and warps a program (`NUM_WARPS`).

In GRPO's recorded step at 128 rows the kernel `_race` took about 82 µs a token on an H200
(results/reference/h200x2-dense-20261128), where reading the logits alone takes about 13 µs at 3 TB/s. Measured
here on an H200 (results/reference/h200x2-pdl-20261128): 82.8 µs a draw with 512 programs of 4 warps, 75.4 with 8
warps (now the default), 75.1-78.6 with more programs; more warps to cover the Philox draws' and logarithms' latency
helped a little, finer slicing nothing; the draw stays at about 0.5 TB/s of logits. The time here is the whole op (the kernel, then the argmax over each row's slices and a gather), so it
is a little more than the kernel alone. Each line says whether the variant drew the default geometry's tokens: for
a given batch, vocabulary and `QUARTER` a column's Philox counter depends on the row, step and column alone, not on
the slicing; `QUARTER` changes draws (four columns share a counter).

    PYTHONPATH=. python benchmarks/race_bench.py --rows 32 128 --programs 512 1024 2048 4096 --warps 4 8
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from decode_attention_bench import graph_time  # this script's folder

import zbench.engine.race_sampling as rs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[128], help="rows a GPU draws for (GRPO 128, PPO 32)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=64, help="draws captured in the graph (steps of a rollout)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--programs", type=int, nargs="+", default=[rs.PROGRAMS])
    parser.add_argument("--quarter", type=int, nargs="+", default=[rs.QUARTER])
    parser.add_argument("--warps", type=int, nargs="+", default=[rs.NUM_WARPS])
    args = parser.parse_args()
    default = (rs.PROGRAMS, rs.QUARTER, rs.NUM_WARPS)

    for rows in args.rows:
        g = torch.Generator("cuda").manual_seed(0)
        logits = (3 * torch.randn(rows, args.vocab, device="cuda", generator=g)).to(getattr(torch, args.dtype))
        seed = torch.tensor([1234], device="cuda")
        step = torch.tensor([7], device="cuda")
        rs.PROGRAMS, rs.QUARTER, rs.NUM_WARPS = default
        reference = rs.race(logits, seed, step, 1.0)
        read_mb = logits.numel() * logits.element_size() / 1e6
        for programs, quarter, warps in itertools.product(args.programs, args.quarter, args.warps):
            rs.PROGRAMS, rs.QUARTER, rs.NUM_WARPS = programs, quarter, warps
            count, chunk = rs.splits(rows, args.vocab)
            row = {"device": torch.cuda.get_device_name(), "rows": rows, "vocab": args.vocab, "dtype": args.dtype,
                   "calls": args.calls, "repeats": args.repeats, "programs": programs, "quarter": quarter,
                   "warps": warps, "slices": count, "columns_per_slice": chunk}
            tokens = rs.race(logits, seed, step, 1.0)
            us = graph_time(functools.partial(rs.race, logits, seed, step, 1.0), args.calls, args.repeats)
            print(json.dumps(row | {"us_per_draw": us, "logits_tb_per_s": read_mb / us,
                                    "same_tokens_as_default": bool(torch.equal(tokens, reference))}), flush=True)


if __name__ == "__main__":
    main()
