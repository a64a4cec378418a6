"""Peak host memory of one actor loss's log-prob and entropy pass, forward and backward, over bf16 logits of a
Qwen3-sized vocabulary: zbench's chunked, checkpointed computation against computing it over the whole micro-batch
at once (what the engine did before). Each variant runs in its own process; the figure is the growth of the
process's peak resident memory over what the logits themselves take.

    python benchmarks/logprob_memory.py --seqs 2 --positions 513 --vocab 151936

On a GPU the same tensors would sit in device memory; this measures the host-side equivalent on the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource

import torch


def _whole(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float() / temperature
    logp = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    ent = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, ent


def _measure(variant: str, seqs: int, positions: int, vocab: int, queue: mp.Queue) -> None:
    from zbench.engine import algos

    torch.manual_seed(0)
    logits = torch.randn(seqs, positions, vocab, dtype=torch.bfloat16).requires_grad_(True)  # no float32 temporary
    labels = torch.randint(0, vocab, (seqs, positions))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if variant == "chunked":
        logp, ent = algos.token_logprobs_and_entropy(logits, labels, 1.0, with_entropy=True, entropy_grad=False)
    else:
        z_logp, z_ent = _whole(logits, labels, 1.0)
        logp, ent = z_logp, z_ent.detach()
    (logp.sum() + 0.0 * ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"variant": variant, "seqs": seqs, "positions": positions, "vocab": vocab,
               "logits_bf16_gb": logits.numel() * 2 / 2**30, "peak_growth_gb": (peak - before) / 2**20})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--positions", type=int, default=513)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for variant in ("whole", "chunked"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(variant, args.seqs, args.positions, args.vocab, queue))
        proc.start()
        print(json.dumps(queue.get()), flush=True)
        proc.join()


if __name__ == "__main__":
    main()
