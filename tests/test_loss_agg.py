"""A token-mean loss is the mean over every response token of an optimizer step, so the micro-batch geometry (size,
grouping, rows sorted by length) is a speed choice only: real DeepSpeed on CPU, the embedded tiny model. Under
`micro-token-mean` (each micro-batch's own mean weighs the same) the update moves with the micro-batch size."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from test_engine_case import make_case, records, train
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict
from zbench.engine.batches import (
    in_row_order,
    length_order,
    micro_batches,
    mini_batch_tokens,
    shard,
    token_share_denominator,
)
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def test_mini_batch_tokens_follow_the_ranks_mini_batches():
    """Two ranks, two mini-batches each: a row's count is that of its optimizer step over both ranks, as `shard` then
    `micro_batches` lay the rows out."""
    lengths = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    mask = (torch.arange(8)[None] < lengths[:, None]).long()
    counts = mini_batch_tokens(mask, world=2, rows_per_rank=2)
    step1, step2 = 1 + 2 + 5 + 6, 3 + 4 + 7 + 8
    assert counts.tolist() == [step1, step1, step2, step2, step1, step1, step2, step2]
    for rank in shard({"m": mask, "c": counts}, 2):  # what each rank's k-th mini-batch reads
        for k, mini in enumerate(micro_batches(rank, 2)):
            assert (mini["c"] == (step1, step2)[k]).all()
    # the micro-batch sums, averaged by DeepSpeed over 3 micro-batches and 2 ranks, come to the step's token mean
    assert 6 * token_share_denominator(step1, micro_batches=3, world=2) == step1


def test_length_order_and_back():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    order = length_order({"attention_mask": mask})
    assert order.tolist() == [1, 3, 0, 2]  # longest first, ties in row order
    rows = torch.arange(4.0)[:, None] * 10
    assert torch.equal(in_row_order(rows[order], order), rows)
    assert in_row_order(rows, None) is rows


def _updated(raw: dict, batch: dict[str, torch.Tensor], model_path: str) -> tuple[dict, list[torch.Tensor]]:
    worker = PolicyWorker(from_dict(raw), 0, 1, tempfile.mkdtemp(prefix="zbench-agg-"), model_path)
    worker.join("127.0.0.1", free_port())
    worker.setup()
    stats = worker.update_actor(dict(batch))
    return stats, [p.detach().clone() for p in worker.engine.module.parameters()]


def test_token_mean_update_does_not_depend_on_micro_batches():
    """One GRPO update of eight sequences of uneven lengths: micro-batches of 1, 2 (rows sorted by length, or not)
    and 8 move the weights alike and report the same statistics under token-mean; under micro-token-mean, micro
    2 and 8 differ (and 8, one micro-batch, equals token-mean's)."""
    model_path = str(resolve_model("tiny"))
    batch = _batch(pad_id=0)
    runs = {}
    for name, micro, sort, agg in [("t8", 8, True, "token-mean"), ("t1", 1, True, "token-mean"),
                                   ("t2-sorted", 2, True, "token-mean"), ("t2-rows", 2, False, "token-mean"),
                                   ("m8", 8, True, "micro-token-mean"), ("m2", 2, True, "micro-token-mean")]:
        raw = _cfg(actor={"micro_batch_size_per_gpu": micro, "loss_agg": agg}, trainer={"sort_micro_batches": sort})
        runs[name] = _updated(raw, batch, model_path)
    base_stats, base_params = runs["t8"]
    assert base_stats["actor/grad_norm"] > 0
    for name in ("t1", "t2-sorted", "t2-rows", "m8"):
        stats, params = runs[name]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert stats[key] == pytest.approx(base_stats[key], rel=1e-4, abs=1e-6), (name, key)
        assert torch.allclose(stats["old_log_probs"], base_stats["old_log_probs"], atol=1e-5), name  # row order
        assert _moved_apart(params, base_params) < 1e-3, f"{name} moved the weights differently"
    m2_stats, m2_params = runs["m2"]
    assert m2_stats["actor/pg_loss"] != pytest.approx(base_stats["actor/pg_loss"], rel=1e-3)
    assert _moved_apart(m2_params, base_params) > 1e-2


def _moved_apart(params: list[torch.Tensor], base: list[torch.Tensor]) -> float:
    """The share of weights more than 1e-6 apart after the two updates. Adam's first step moves a weight by about
    lr * g / (|g| + eps): where a gradient is near eps (1e-8), rounding in the sums moves it measurably, so equal
    gradients leave a handful of such weights apart (12 of 131k here), while unequal ones move about one in ten."""
    apart = sum(int(((a - b).abs() > 1e-6).sum()) for a, b in zip(params, base, strict=True))
    return apart / sum(a.numel() for a in base)


def test_loss_agg_is_checked():
    with pytest.raises(ConfigError, match=re.escape(
            "actor.loss_agg: 'seq-mean' is not one of 'token-mean', 'micro-token-mean'")):
        from_dict(_cfg(actor={"loss_agg": "seq-mean"}))
    with pytest.raises(ConfigError, match=re.escape("critic.loss_agg")):
        from_dict({"critic": {"loss_agg": "mean"}})


def test_two_ranks_step_alike_at_any_micro_batch(tmp_path: Path):
    """PPO on two ranks (DeepSpeed averaging their gradients), one step: actor and critic micro-batches of 1 and of 4
    sequences give the same losses and gradient norms, the step's token means over both ranks."""
    runs = []
    for micro in (1, 4):
        case = make_case(tmp_path, f"micro{micro}", steps=1, algorithm="ppo", zero__stage=2,
                         actor__micro_batch_size_per_gpu=micro, critic__micro_batch_size_per_gpu=micro)
        train(case, timeout=600)
        runs.append(records(case)[0])
    one, four = runs
    assert one["response_length/mean"] == four["response_length/mean"]  # the same samples
    assert one["response_length/max"] > one["response_length/mean"]  # of uneven lengths: the means could differ
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert one[key] == pytest.approx(four[key], rel=1e-4, abs=1e-6), key


def test_sorted_forward_passes_return_rows_in_order():
    """The gradient-free passes sort too (always exact): old and reference log-probs come back in the rows' order,
    as the unsorted passes give them, at a forward micro-batch that cuts the rows in three."""
    model_path = str(resolve_model("tiny"))
    batch = _batch(pad_id=0)
    outs = []
    for sort in (False, True):
        raw = _cfg(actor={"forward_micro_batch_size_per_gpu": 3}, trainer={"sort_micro_batches": sort})
        worker = PolicyWorker(from_dict(raw), 0, 1, tempfile.mkdtemp(prefix="zbench-agg-"), model_path)
        worker.join("127.0.0.1", free_port())
        worker.setup()
        outs.append({**worker.compute_log_prob(batch), **worker.compute_ref_log_prob(batch)})
    assert not torch.equal(length_order(batch), torch.arange(8))  # the sorted pass did reorder them
    for key in ("old_log_probs", "ref_log_probs"):
        assert torch.allclose(outs[0][key], outs[1][key], atol=1e-5), key
        assert outs[0][key].abs().sum() > 0
