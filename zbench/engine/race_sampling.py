"""Sampling a token per row inside the graph loop's recorded decode step: one Triton kernel over the logits, seeded
from device memory, so the whole step (the model, the draw, the EOS bookkeeping) replays as one CUDA graph.

`zbench.engine.rollout.sample_tokens` draws by the exponential race argmax(p / E), E ~ Exp(1), as eager kernels
over a float32 copy of the logits: a cast, a division by the temperature, a softmax, the draws, a division and an
argmax, each a pass over rows x vocabulary (0.05 s of a 32-row rollout's kernels and 0.14 s of a 128-row one's on an
H200, results/reference/h200-prefill-20261127), launched from Python every token. `race` draws from the same
distribution in one pass: argmax over the vocabulary of logit / T - log E, which orders tokens as p / E does. E comes
from Philox (`tl.randint4x`) at a counter of (seed, step, row, column): a draw depends on the rollout's seed and
where it is, never on what ran before, so a replayed graph draws anew each step from the step counter it reads,
and a rollout repeats exactly for its seed on the same device. The vocabulary splits into slices, one program per
(row, slice); each keeps the best score of its slice; `race` takes the best slice of each row.

Triton ships with PyTorch's CUDA builds; `available` says where it runs (a CUDA device, or Triton's interpreter on
the CPU, which is how the kernel is tested). Elsewhere the op draws the race with a `torch.Generator` seeded from
(seed, step): the same distribution, other draws.
"""

from __future__ import annotations

from typing import Any

import torch

from zbench.engine.decode_attention import available

QUARTER = 256  # columns a lane block holds; four of them share a Philox counter (1,024 columns an iteration)
PROGRAMS = 512  # (row, slice) programs to aim for: a few per SM, so that loads overlap
MAX_SPLITS = 64
# warps a program. 8 against 4 on an H200, a bf16 vocabulary of 151,936: 75.4 against 82.8 us a draw at 128 rows,
# 24.7 against 26.6 at 32, the same tokens (results/reference/h200x2-pdl-20261128; `benchmarks/race_bench.py --warps`)
NUM_WARPS = 8


def splits(rows: int, vocab: int) -> tuple[int, int]:
    """How `race` cuts each row's vocabulary: (slices, columns per slice), a slice being whole iterations of
    4 x `QUARTER` columns; enough slices for about `PROGRAMS` programs, each at least one iteration long."""
    step = 4 * QUARTER
    iterations = -(-vocab // step)
    count = max(1, min(MAX_SPLITS, iterations, -(-PROGRAMS // max(rows, 1))))
    per = -(-iterations // count)
    return -(-iterations // per), per * step  # no slice wholly past the vocabulary


@torch.library.custom_op("zbench::race", mutates_args=())
def race(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, temperature: float) -> torch.Tensor:
    """One token per row of `logits` (B, V): the argmax at temperature 0, else a draw from softmax(logits / T).

    `seed` and `step` are one-element int64 tensors on the logits' device, read by the kernel (not the host), so a
    recorded graph draws anew each replay as `step` moves on. Returns (B,) int64."""
    _check(logits, seed, step)
    if temperature <= 0:
        return logits.argmax(dim=-1)
    rows, vocab = logits.shape
    if not available(logits.device):
        return _race_with_generator(logits, int(seed.item()), int(step.item()), temperature)
    from zbench.engine._race_kernels import _race

    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    count, chunk = splits(rows, vocab)
    vals = torch.empty(rows, count, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, count, dtype=torch.int64, device=logits.device)
    _race[(rows, count)](logits, seed, step, vals, idxs, logits.stride(0), vocab, rows, 1.0 / temperature, chunk,
                         QUARTER=QUARTER, SPLITS=count, num_warps=NUM_WARPS)
    return idxs.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)


@race.register_fake
def _(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, temperature: float) -> Any:
    _check(logits, seed, step)
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _check(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"race: logits must be (rows, vocabulary) floats; got {logits.dtype} {tuple(logits.shape)}")
    for name, t in (("seed", seed), ("step", step)):
        if t.dtype != torch.int64 or t.numel() != 1 or t.device != logits.device:
            raise ValueError(f"race: {name} must be one int64 on the logits' device ({logits.device}); got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _race_with_generator(logits: torch.Tensor, seed: int, step: int, temperature: float) -> torch.Tensor:
    """The race where Triton cannot run: the eager loop's draw (`sample_tokens`), its generator seeded from
    (seed, step)."""
    from zbench.engine.rollout import sample_tokens

    generator = torch.Generator(logits.device).manual_seed((seed * 1_000_003 + step) % 2**63)
    return sample_tokens(logits, temperature, 1.0, generator)

