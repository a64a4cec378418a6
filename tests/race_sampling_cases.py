"""The graph loop's in-graph sampler (`zbench.engine.race_sampling`) as its Triton kernel runs it, on CPU tensors
through Triton's interpreter: it draws from softmax(logits / T), across the slices a row's vocabulary is cut into and
in the last, partly filled iteration, never a column outside the vocabulary, and repeats for its (seed, step).

Triton reads `TRITON_INTERPRET` when it is imported, so these cases run in a process of their own that sets it first
(`test_triton_kernels.py`); collected anywhere else they skip. The interpreter runs a program at a time, so the
kernel's blocks are made small here (`QUARTER`) to keep the vocabularies several iterations and slices long."""

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run through test_triton_kernels.py",
                allow_module_level=True)
pytest.importorskip("triton")

import triton  # after the interpreter check, which triton must not precede
import triton.language as tl

from zbench.engine import race_sampling as rs
from zbench.engine._race_kernels import _exponential
from zbench.engine.decode_attention import available


@triton.jit
def _apply_exponential(bits_ptr, out_ptr, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(out_ptr + at, _exponential(tl.load(bits_ptr + at)))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(rs, "QUARTER", 16)  # 64 columns an iteration


def _at(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def test_the_interpreter_runs_the_kernel():
    assert available(torch.device("cpu"))


def test_draws_follow_the_softmax_and_never_leave_the_vocabulary():
    head = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    logits = torch.full((300, 70), float("-inf"))  # two iterations, the second mostly past the real columns
    logits[:, :5] = head
    draws = torch.cat([rs.race(logits, _at(11), _at(step), 0.7) for step in range(4)])
    assert draws.max() < 4  # -30 has a chance of 1e-20 here, and -inf none
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert torch.allclose(freq, (head / 0.7).softmax(-1), atol=0.04)  # 1,200 draws: standard error <= 0.0125


def test_a_row_cut_into_slices_draws_from_each():
    assert rs.splits(8, 700) == (11, 64)  # 11 slices of one iteration, the last partly past the vocabulary
    logits = torch.full((8, 700), float("-inf"), dtype=torch.bfloat16)
    logits[:, 3] = 1.0
    logits[:, 690] = 1.0
    draws = torch.cat([rs.race(logits, _at(5), _at(step), 1.0) for step in range(12)])
    assert set(draws.tolist()) == {3, 690}
    assert 0.25 < (draws == 690).float().mean() < 0.75  # 96 draws of a fair coin: 5 standard errors


def test_the_slicing_changes_no_draw(monkeypatch):
    """A column's draw depends on (seed, step, row, column) alone, so cutting the vocabulary into more or fewer
    slices (`PROGRAMS`, as `benchmarks/race_bench.py` varies it) draws the same tokens."""
    logits = torch.randn(8, 700, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    draws = {}
    for programs in (8, 64, 512):
        monkeypatch.setattr(rs, "PROGRAMS", programs)
        draws[rs.splits(8, 700)[0]] = rs.race(logits, _at(9), _at(2), 1.0)
    assert sorted(draws) == [1, 6, 11]  # one slice a row, slices of 2 iterations, one an iteration
    assert all(torch.equal(d, draws[1]) for d in draws.values())


def test_a_seed_and_step_repeat_and_others_differ():
    logits = torch.zeros(40, 64)
    a = rs.race(logits, _at(1), _at(0), 1.0)
    assert torch.equal(a, rs.race(logits, _at(1), _at(0), 1.0))
    assert not torch.equal(a, rs.race(logits, _at(1), _at(1), 1.0))
    assert not torch.equal(a, rs.race(logits, _at(2), _at(0), 1.0))
    assert len(set(a.tolist())) > 10  # rows draw apart


def test_strided_rows_and_the_greedy_limit():
    wide = torch.randn(6, 200)
    logits = wide[:, :130]  # rows 200 apart
    assert logits.stride(0) == 200
    assert torch.equal(rs.race(logits, _at(0), _at(0), 0.0), logits.argmax(-1))
    assert torch.equal(rs.race(logits, _at(0), _at(0), 1e-4), logits.argmax(-1))  # the noise cannot reorder them
    assert rs.race(logits, _at(3), _at(9), 1.0).max() < 130


def test_exponential_draws_hold_their_bits_at_both_ends():
    """-log(1 - v) from 32 bits, v their midpoint: near 0 the series keeps the bits apart (these draws win the race),
    and near 1 the complemented bits keep 1 - v off 0, so no column is ever ruled out."""
    bits = [0, 1, 2, 2**20, 2**22 - 1, 2**22, 2**31, 2**32 - 2**22, 2**32 - 129, 2**32 - 128, 2**32 - 2, 2**32 - 1]
    bits += [0] * (16 - len(bits))
    out = torch.empty(16, dtype=torch.float32)
    _apply_exponential[(1,)](torch.tensor(bits, dtype=torch.int64).to(torch.uint32), out, N=16)
    for r, e in zip(bits, out.tolist(), strict=True):
        expected = -math.log1p(-(r + 0.5) / 2**32)
        assert math.isfinite(e) and e == pytest.approx(expected, rel=2e-6), (r, e, expected)
