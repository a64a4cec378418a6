"""A token-mean loss is the mean over every response token of an optimizer step, so the micro-batch geometry (size,
grouping, rows sorted by length) is a speed choice only: real DeepSpeed on CPU, the embedded tiny model. Under
`micro-token-mean` (each micro-batch's own mean weighs the same) the update moves with the micro-batch size."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict
from zbench.engine import lm_head
from zbench.engine.batches import (
    in_row_order,
    left_pad,
    length_order,
    micro_batches,
    mini_batch_tokens,
    sequence_batch,
    shard,
    token_share_denominator,
)
from zbench.engine.cluster import free_port
from zbench.engine.workers import CriticWorker, PolicyWorker
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
    """Longest first, by what sets a layout's width: prompt and response tokens (maskless), or the prompt alone."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    batch = {"attention_mask": mask, "responses": torch.zeros(4, 2)}
    assert length_order(batch).tolist() == [1, 3, 0, 2]  # ties in row order
    assert length_order(batch, maskless=False).tolist() == [1, 0, 3, 2]  # prompts of 3, 2, 2, 1 tokens
    rows = torch.arange(4.0)[:, None] * 10
    order = length_order(batch)
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
    2 and 8 differ (and 8, one micro-batch, equals token-mean's). A head that takes the loss itself
    (`model.head_loss_in_forward`, token chunks of 3) divides each chunk's share by its micro-batch's denominator
    under both."""
    model_path = str(resolve_model("tiny"))
    batch = _batch(pad_id=0)
    runs = {}
    for name, micro, sort, agg, in_head in [
            ("t8", 8, True, "token-mean", False), ("t1", 1, True, "token-mean", False),
            ("t2-sorted", 2, True, "token-mean", False), ("t2-rows", 2, False, "token-mean", False),
            ("m8", 8, True, "micro-token-mean", False), ("m2", 2, True, "micro-token-mean", False),
            ("t2-head", 2, True, "token-mean", True), ("m2-head", 2, True, "micro-token-mean", True)]:
        raw = _cfg(actor={"micro_batch_size_per_gpu": micro, "loss_agg": agg}, trainer={"sort_micro_batches": sort},
                   model={"head_loss_in_forward": in_head})
        with mock.patch.object(lm_head, "DEFAULT_CHUNK_TOKENS", 3):  # chunks that split rows and micro-batches
            runs[name] = _updated(raw, batch, model_path)
    base_stats, base_params = runs["t8"]
    assert base_stats["actor/grad_norm"] > 0
    m2_head_stats, m2_head_params = runs.pop("m2-head")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m2_head_stats[key] == pytest.approx(runs["m2"][0][key], rel=1e-4, abs=1e-6), key
    assert _moved_apart(m2_head_params, runs["m2"][1]) < 1e-3
    for name in ("t1", "t2-sorted", "t2-rows", "m8", "t2-head"):
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


def _rank_update(rank: int, world: int, raw: dict, batch: dict[str, torch.Tensor], port: int, out: str) -> None:
    """One rank of a token-mean actor update in its own process (a gloo group of `world` ranks): its statistics and
    weights into `out`."""
    worker = PolicyWorker(from_dict(raw), rank, world, tempfile.mkdtemp(prefix="zbench-agg-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", port)
    worker.setup()
    stats = worker.update_actor(batch)
    torch.save({"stats": {k: v for k, v in stats.items() if not torch.is_tensor(v)},
                "params": [p.detach().clone() for p in worker.engine.module.parameters()]}, out)
    worker.shutdown()


def _ranks(world: int, raw: dict, shards: list[dict[str, torch.Tensor]], tmp: Path) -> tuple[dict, list[torch.Tensor]]:
    """The ranks' mean statistics (as the trainer averages them) and rank 0's weights."""
    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), free_port("127.0.0.1")
    outs = [str(tmp / f"w{world}-rank{r}.pt") for r in range(world)]
    procs = [ctx.Process(target=_rank_update, args=(r, world, raw, shards[r], port, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"rank process exited {p.exitcode}"
    loaded = [torch.load(o) for o in outs]
    stats = {k: sum(r["stats"][k] for r in loaded) / world for k in loaded[0]["stats"]}
    return stats, loaded[0]["params"]


def test_two_ranks_make_the_one_rank_update(tmp_path: Path):
    """Two ranks (DeepSpeed averaging their gradients over gloo), two mini-batches of uneven token counts, two
    epochs, KL loss and entropy, micro-batches of one sequence cut from sorted rows: the same statistics and weights
    as one rank given each optimizer step's rows of both ranks as one micro-batch."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in torch.randint(2, 14, (16,), generator=g)]
    p_ids, p_mask = left_pad(prompts, 0)
    responses = torch.randint(3, 90, (16, 7), generator=g)
    r_mask = (torch.arange(7)[None] < torch.randint(1, 8, (16, 1), generator=g)).long()
    batch = sequence_batch(p_ids, p_mask, responses, r_mask)
    batch.update(advantages=torch.randn(16, 7, generator=g) * r_mask, ref_log_probs=-torch.rand(16, 7, generator=g) * 3,
                 old_log_probs=-torch.rand(16, 7, generator=g) * 3)

    def raw(world: int, micro: int) -> dict:
        return {"algorithm": "grpo", "rollout": {"n": 4}, "model": {"dtype": "fp32"},
                "trainer": {"world_size": world, "train_batch_size": 4, "device": "cpu"},
                "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_gpu": micro, "lr": 1e-3, "ppo_epochs": 2,
                          "use_kl_loss": True, "entropy_coeff": 0.01}}

    two = dict(batch, step_tokens=mini_batch_tokens(r_mask, world=2, rows_per_rank=4))
    assert two["step_tokens"][0] != two["step_tokens"][4]  # the two optimizer steps hold different token counts
    # one rank: step k's rows of rank 0 then of rank 1 (rank r holds rows 8r..8r+7, its step k rows 8r+4k..8r+4k+3)
    steps = torch.cat([torch.arange(8 * r + 4 * k, 8 * r + 4 * k + 4) for k in range(2) for r in range(2)])
    ref_stats, ref_params = _ranks(1, raw(1, 8), [{k: v[steps] for k, v in batch.items()}], tmp_path)
    stats, params = _ranks(2, raw(2, 1), shard(two, 2), tmp_path)
    assert ref_stats["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
                "actor/grad_norm"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-7), key
    assert _moved_apart(params, ref_params) < 1e-3


def test_critic_update_does_not_depend_on_micro_batches():
    """The value loss likewise: one PPO critic update at micro-batches of 1 (rows sorted) and of 8, and its values
    pass (sorted) returns the rows in order."""
    model_path = str(resolve_model("tiny"))
    batch = _batch(pad_id=0)
    g = torch.Generator().manual_seed(4)
    batch.update(values=torch.randn(8, 6, generator=g) * batch["response_mask"],
                 returns=torch.randn(8, 6, generator=g) * batch["response_mask"])
    runs = []
    for micro, sort in ((8, False), (1, True)):
        raw = {"algorithm": "ppo", "model": {"dtype": "fp32"}, "trainer": {"world_size": 1, "train_batch_size": 8,
                                                                          "device": "cpu", "sort_micro_batches": sort},
               "actor": {"ppo_mini_batch_size": 8}, "critic": {"micro_batch_size_per_gpu": micro, "lr": 1e-3}}
        worker = CriticWorker(from_dict(raw), 0, 1, tempfile.mkdtemp(prefix="zbench-agg-"), model_path)
        worker.join("127.0.0.1", free_port())
        worker.setup()
        values = worker.compute_values(batch)["values"]
        runs.append((values, worker.update_critic(batch)))
    (values8, stats8), (values1, stats1) = runs
    assert torch.allclose(values1, values8, atol=1e-5) and values8.abs().sum() > 0
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert stats1[key] == pytest.approx(stats8[key], rel=1e-4, abs=1e-6), key
    # a share of tokens: one whose clipped and unclipped errors nearly tie may fall either way with the values'
    # last bits, which the micro-batch's width moves (one of these 33 did, with the packages of 2026-11-29)
    tokens = int(batch["response_mask"].sum())
    assert abs(stats1["critic/vf_clipfrac"] - stats8["critic/vf_clipfrac"]) <= 1 / tokens + 1e-6
    assert stats8["critic/grad_norm"] > 0


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
