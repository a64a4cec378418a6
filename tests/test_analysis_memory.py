"""The ZeRO memory estimator against transformers' parameter count and DeepSpeed's own estimators."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
)
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
)
from transformers import Qwen3Config, Qwen3ForCausalLM

from zbench.analyze.memory import MODEL_DIMS, estimate_case, largest_layer_params, model_states, param_count
from zbench.config import from_dict


@pytest.mark.parametrize("name", sorted(MODEL_DIMS))
def test_param_count_matches_transformers(name):
    d = MODEL_DIMS[name]
    config = Qwen3Config(vocab_size=d.vocab_size, hidden_size=d.hidden_size, num_hidden_layers=d.num_layers,
                         num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
                         intermediate_size=d.intermediate_size, tie_word_embeddings=d.tie_word_embeddings)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert param_count(d) == sum(p.numel() for p in model.parameters())
    assert largest_layer_params(d) == max(sum(p.numel() for p in m.parameters(recurse=False))
                                          for m in model.modules())


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_against_deepspeed_estimators(dp, capsys):
    d = MODEL_DIMS["qwen3-0.6b"]
    n, big = param_count(d), largest_layer_params(d)
    # Stage 2: DeepSpeed adds the fp32 gradient partition (4 bytes per parameter per rank).
    _, ds_gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=dp, cpu_offload=False)
    assert model_states(n, big, 2, "none", dp).gpu == pytest.approx(ds_gpu - 4 * n / dp, abs=2)
    # Offloaded: DeepSpeed moves the gradient partition to the host; it stays counted on GPU here.
    _, ds_gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=dp, cpu_offload=True)
    assert model_states(n, big, 2, "cpu", dp).gpu == pytest.approx(ds_gpu + 2 * n / dp, abs=2)
    # Stage 3: same working set (4 bytes x largest layer); DeepSpeed's 18 bytes vs 16 partitioned.
    _, ds_gpu, ds_ll = estimate_zero3_model_states_mem_needs(n, big, num_gpus_per_node=dp, cpu_offload=False)
    assert model_states(n, big, 3, "none", dp).gpu == pytest.approx(ds_gpu - 2 * n / dp, abs=2)
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(n, big, num_gpus_per_node=dp)
    assert model_states(n, big, 3, "cpu", dp).gpu == pytest.approx(ds_gpu + 2 * n / dp, abs=2)
    assert ds_ll == 4 * big
    # The "_all_cold" entry points print their tables (and return nothing); they run on our counts.
    estimate_zero2_model_states_mem_needs_all_cold(n, num_gpus_per_node=dp)
    estimate_zero3_model_states_mem_needs_all_cold(n, big, num_gpus_per_node=dp)
    assert f"{int(n / 1e6)}M total params" in capsys.readouterr().out


def test_stage_ordering_and_case_extras():
    d = MODEL_DIMS["qwen3-0.6b"]
    n, big = param_count(d), largest_layer_params(d)
    gpu = [model_states(n, big, s, "none", 4).gpu for s in (0, 1, 2)]
    assert gpu[0] == 16 * n and gpu == sorted(gpu, reverse=True)
    assert model_states(n, big, 1, "none", 4, "fp32").gpu == 4 * n + 4 * n + 2 * n
    off = model_states(n, big, 3, "nvme", 4)
    assert off.nvme == 12 * n // 4 + 2 * n // 4 and off.cpu == 0
    assert model_states(n, big, 2, "nvme", 4).cpu == 12 * n // 4  # ZeRO-1/2 keep "nvme" in CPU memory
    with pytest.raises(ValueError, match="nothing to offload"):
        model_states(n, big, 0, "cpu", 4)
    cfg = {"name": "z3", "algorithm": "ppo", "model": {"path": "qwen3-0.6b"},
           "zero": {"stage": 3, "offload": "none"},
           "trainer": {"world_size": 4, "device": "cuda", "train_batch_size": 16},
           "actor": {"ppo_mini_batch_size": 16, "micro_batch_size_per_gpu": 4},
           "critic": {"micro_batch_size_per_gpu": 4}}
    est = estimate_case(from_dict(cfg), name="z3")
    assert est.precision == "bf16" and est.critic is not None
    assert est.gpu_bytes == 2 * est.actor.gpu + 2 * n + 2 * n  # actor, critic, reference, replica
    grpo = estimate_case(from_dict(cfg | {"algorithm": "grpo", "zero": {"stage": 3, "offload": "cpu"},
                                          "rollout": {"n": 2}}))
    assert grpo.critic is None and not grpo.replica_on_gpu and grpo.cpu_bytes > 2 * n


def test_tiny_dims_match_the_built_model() -> None:
    """The estimator's table for the embedded default must describe the model the engine actually trains."""
    from transformers import AutoModelForCausalLM

    from zbench.analyze.memory import MODEL_DIMS, param_count
    from zbench.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    assert param_count(MODEL_DIMS["tiny"]) == sum(p.numel() for p in model.parameters())
