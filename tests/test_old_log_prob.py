"""The old-log-prob pass is skipped only where it is redundant: with one epoch of one mini-batch per step, the update
that takes the policy's own (detached) log-probs as the old ones makes the same update as one fed the pass's
output (real DeepSpeed on CPU, the embedded tiny model); elsewhere the pass runs."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from test_engine_case import make_case, records, train

from zbench.config import ConfigError, from_dict, load_case_config, rollout_engine
from zbench.engine.batches import left_pad, sequence_batch
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model
from zbench.runroot.summary import case_summary_row

ONE_MINI_BATCH = {"algorithm": "grpo", "rollout": {"n": 4}, "model": {"dtype": "fp32"},
                  "trainer": {"world_size": 1, "train_batch_size": 2, "device": "cpu"},
                  "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_gpu": 4, "lr": 1e-3,
                            "use_kl_loss": True}}


def _cfg(**sections: dict) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in ONE_MINI_BATCH.items()}
    for key, values in sections.items():
        raw[key] = {**raw.get(key, {}), **values}
    return raw


def test_pass_runs_only_where_the_update_cannot_give_it():
    assert not from_dict(_cfg()).old_log_prob_pass
    assert from_dict(_cfg(actor={"recompute_old_log_prob": "always"})).old_log_prob_pass
    assert from_dict(_cfg(actor={"ppo_epochs": 2})).old_log_prob_pass  # the second epoch's policy has moved
    assert from_dict(_cfg(actor={"ppo_mini_batch_size": 1})).old_log_prob_pass  # so has the second mini-batch's
    assert from_dict(_cfg(algo={"use_kl_in_reward": True})).old_log_prob_pass  # the reward needs it first
    with pytest.raises(ConfigError, match=re.escape(
            "actor.recompute_old_log_prob: 'never' is not one of 'auto', 'always'")):
        from_dict(_cfg(actor={"recompute_old_log_prob": "never"}))


def _batch(pad_id: int) -> dict[str, torch.Tensor]:
    """Eight sequences (two prompts x four samples) of uneven prompt and response lengths, with advantages and
    reference log-probs."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (9, 4, 12, 7, 5, 11, 3, 8)]
    p_ids, p_mask = left_pad(prompts, pad_id)
    responses = torch.randint(3, 90, (8, 6), generator=g)
    r_mask = (torch.arange(6)[None] < torch.tensor([6, 2, 5, 6, 3, 6, 1, 4])[:, None]).long()
    batch = sequence_batch(p_ids, p_mask, responses, r_mask)
    batch["advantages"] = torch.randn(8, 6, generator=g) * r_mask
    batch["ref_log_probs"] = -torch.rand(8, 6, generator=g) * 3
    return batch


def assert_same_update(reference: dict, other: dict, params: tuple | None = None, atol: float = 1e-7) -> None:
    """`other`, what `update_actor` returned for the reference batch, is `reference`'s update: the same log-probs and
    statistics (a gradient that moved something); with `params` = (named parameters, parameters) of the two engines
    after the step, the same weights within `atol`."""
    assert torch.allclose(other["old_log_probs"], reference["old_log_probs"], atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert other[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    assert reference["actor/grad_norm"] > 0
    if params is not None:
        for (name, a), b in zip(*params, strict=True):
            assert torch.allclose(a, b, atol=atol), name


def test_skipped_pass_gives_the_same_update():
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-oldlp-")
    computed = PolicyWorker(from_dict(_cfg()), 0, 1, case_dir, model_path)
    computed.join("127.0.0.1", free_port())
    computed.setup()
    reused = PolicyWorker(from_dict(_cfg()), 0, 1, case_dir, model_path)
    reused.setup()
    for a, b in zip(computed.engine.module.parameters(), reused.engine.module.parameters(), strict=True):
        assert torch.equal(a, b)  # the same start
    batch = _batch(pad_id=0)
    old = computed.compute_log_prob(batch)["old_log_probs"]
    stats_computed = computed.update_actor({**batch, "old_log_probs": old})
    stats_reused = reused.update_actor(batch)

    # the update's own log-probs are the pass's, and it returns them for what reads them after the step
    assert torch.allclose(stats_reused.pop("old_log_probs"), old, atol=1e-5)
    assert "old_log_probs" not in stats_computed
    assert stats_reused.keys() == stats_computed.keys()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert stats_reused[key] == pytest.approx(stats_computed[key], rel=1e-4, abs=1e-6), key
    assert stats_reused["actor/grad_norm"] > 0
    assert stats_reused["actor/ppo_kl"] == 0 and stats_reused["actor/pg_clipfrac"] == 0  # ratio 1 exactly
    moved = 0.0
    start = PolicyWorker(from_dict(_cfg()), 0, 1, case_dir, model_path)
    start.setup()
    for a, b, s in zip(computed.engine.module.parameters(), reused.engine.module.parameters(),
                       start.engine.module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), "the two updates moved the weights differently"
        moved = max(moved, float((a - s).detach().abs().max()))
    assert moved > 1e-4  # the update did move them


def test_update_without_old_log_probs_is_refused_across_mini_batches():
    model_path = str(resolve_model("tiny"))
    raw = _cfg(actor={"ppo_mini_batch_size": 1})
    worker = PolicyWorker(from_dict(raw), 0, 1, tempfile.mkdtemp(prefix="zbench-oldlp-"), model_path)
    worker.join("127.0.0.1", free_port())
    worker.setup()
    with pytest.raises(ValueError, match="needs old_log_probs unless it runs one epoch of one mini-batch"):
        worker.update_actor(_batch(pad_id=0))


def test_case_without_the_pass_records_it(tmp_path: Path):
    """A GRPO case of one mini-batch per step runs no old-log-prob phase, says so in result.json, and still reports
    the statistics that read the old log-probs (from the update's own). It samples with zbench's graph loop (eager
    on a CPU), whose attention and merged projections result.json records too."""
    case = make_case(tmp_path, "grpo", steps=2, algorithm="grpo", rollout__n=4, zero__stage=2,
                     actor__micro_batch_size_per_gpu=8, rollout__cuda_graph=True)
    train(case, timeout=600)
    result = json.loads((case / "result.json").read_text())
    assert result["old_log_prob_pass"] is False
    assert result["fused_head"] is True and result["compiled_layers"] == 0  # what took effect (CPU: eager layers)
    assert result["graph_decode_attention"] == "sdpa"  # auto, where Triton's kernels cannot run
    assert result["graph_decode_kernels"] is None  # the Triton attention's switches: none with SDPA
    assert result["graph_steps_per_graph"] == 1  # one step at a time off CUDA
    # q/k/v and gate/up of both layers, each one matrix multiply; the replica still took the trained weights by name
    assert result["graph_merged_projections"] == 4
    assert result["graph_sampling"] == "eager"  # the eager loop of a CPU draws between steps
    assert result["graph_prompt_width"] is None  # widths as they come: the eager loop records nothing to reuse
    assert result["rollout_engine"] == "hf-loop"  # the loop, run eagerly, as `zbench show` predicts from the config
    assert rollout_engine(load_case_config(case / "config.yaml"), on_cuda=False) == "hf-loop"
    row = case_summary_row(case.parent, case.name)  # the summary tells the loop from transformers' generate
    assert row["rollout_engine"] == "hf-loop" and row["rollout_backend"] == "hf"
    # Ray raises its workers' niceness by 15 (its case-sensitive setting RAY_worker_niceness), from what they inherit
    raised = int(os.environ.get("RAY_worker_niceness", 15))  # noqa: SIM112
    assert result["worker_niceness"] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + raised)
    for rec in records(case):
        assert "timing_s/old_log_prob" not in rec
        assert rec["actor/ppo_kl"] == 0 and rec["actor/pg_clipfrac"] == 0
        assert rec["actor/grad_norm"] > 0 and "timing_s/update_actor" in rec
        # the loop was told the rows come as runs of 4 samples; SDPA reads every row's cache, so none shared it
        assert rec["perf/rollout_shared_rows"] == 1
