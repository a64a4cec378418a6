"""The vLLM backend: selection, version pairs, weight naming and bucketing with real tensors on the CPU; the
engine itself with vLLM where vLLM and a GPU are present (marked `vllm`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from zbench.config import ConfigError, dump_yaml, from_dict
from zbench.engine.batches import gather, rollout_outputs, rollout_shards, shard
from zbench.engine.rollout import size_buckets
from zbench.engine.vllm_rollout import (
    check_versions,
    engine_arguments,
    fitted_kv_cache_bytes,
    kv_bytes_per_token,
    model_runner_of,
    parallel_args,
    select_backend,
    strip_left_padding,
    vllm_weights,
)


def test_version_pairs() -> None:
    check_versions("0.26.0", "2.11.0+cu130")
    check_versions("0.30.1", "2.13.0")
    check_versions("0.33.0", "2.14.1")
    with pytest.raises(ConfigError, match=r"vLLM 0.26.0 is built for torch 2.11, but torch 2.13.0 is installed"):
        check_versions("0.26.0", "2.13.0")
    with pytest.raises(ConfigError, match=r"vLLM 0.20.1 is not a tested version; tested pairs: vLLM 0.26 \+ torch 2.11"):
        check_versions("0.20.1", "2.9.0")


def test_backend_selection() -> None:
    assert select_backend("hf", True, "0.26.0", "2.11.0") == "hf"
    assert select_backend("auto", False, "0.26.0", "2.11.0") == "hf"  # no CUDA
    assert select_backend("auto", True, None, "2.11.0") == "hf"  # not installed
    assert select_backend("auto", True, "0.26.0", "2.13.0") == "hf"  # wrong pair: auto falls back
    assert select_backend("auto", True, "0.26.0", "2.11.0") == "vllm"
    assert select_backend("vllm", True, "0.26.0", "2.11.0") == "vllm"
    # where the graph loop was measured faster, auto takes it; a named backend stays as named
    assert select_backend("auto", True, "0.26.0", "2.11.0", graph_loop=True) == "hf"
    assert select_backend("vllm", True, "0.26.0", "2.11.0", graph_loop=True) == "vllm"
    with pytest.raises(ConfigError, match="'vllm' needs a CUDA GPU; use 'hf'"):
        select_backend("vllm", False, "0.26.0", "2.11.0")
    with pytest.raises(ConfigError, match=r"pip install 'zbench\[vllm\]'"):
        select_backend("vllm", True, None, "2.11.0")
    with pytest.raises(ConfigError, match=r"built for torch 2\.11"):
        select_backend("vllm", True, "0.26.0", "2.14.0")


def _model(tied: bool) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg)


def test_weight_names_for_vllm() -> None:
    untied = _model(tied=False)
    names = [n for n, _ in vllm_weights(untied.named_parameters(), tied_embeddings=False)]
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert len(names) == len(list(untied.parameters()))
    # a tied lm_head is the embedding in vLLM: never sent, even if a state dict lists it
    tied = _model(tied=True)
    state = list(tied.state_dict().items())
    assert "lm_head.weight" in dict(state)
    sent = dict(vllm_weights(iter(state), tied_embeddings=True))
    assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent
    assert torch.equal(sent["model.embed_tokens.weight"], tied.model.embed_tokens.weight)


def test_size_buckets_cover_every_parameter_once() -> None:
    named = list(_model(tied=False).named_parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in named}
    limit = 8 * 1024
    buckets = list(size_buckets(named, limit))
    flat = [n for b in buckets for n, _ in b]
    assert flat == [n for n, _ in named]
    for b in buckets[:-1]:  # each closed bucket reached the limit, and only with its last tensor
        total = sum(sizes[n] for n, _ in b)
        assert total >= limit and total - sizes[b[-1][0]] < limit
    assert len(list(size_buckets(named, 10**12))) == 1
    assert all(len(b) == 1 for b in size_buckets(named, 1))


def test_kv_cache_fitted_to_one_rollout() -> None:
    """Qwen3-0.6B: 28 layers x 8 KV heads x 128 dims, keys and values in bf16 = 112 KiB per token per GPU (half
    under TP 2); a rollout of 128 sequences of 1024 tokens takes 14 GiB, plus the block vLLM's pool keeps, plus 5%."""
    from zbench.models import qwen3_06b_config

    cfg = qwen3_06b_config()
    assert kv_bytes_per_token(cfg, 1) == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(cfg, 2) == 57_344
    assert kv_bytes_per_token(cfg, 16) == kv_bytes_per_token(cfg, 8)  # 8 KV heads: replicated beyond TP 8
    assert fitted_kv_cache_bytes(cfg, 128, 1024, 1) == int((128 * 64 + 1) * 16 * 114_688 * 1.05)  # + vLLM's own block
    assert fitted_kv_cache_bytes(cfg, 1, 256, 1) // (16 * 114_688) == 17  # one 256-token sequence: 16 blocks + 1
    # a length that is not a whole number of blocks takes whole blocks
    assert fitted_kv_cache_bytes(cfg, 1, 1000, 1) == fitted_kv_cache_bytes(cfg, 1, 1008, 1)
    assert fitted_kv_cache_bytes(cfg, 1, 1009, 1) > fitted_kv_cache_bytes(cfg, 1, 1008, 1)


def test_strip_left_padding() -> None:
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    assert strip_left_padding(ids, (ids != 0).long()) == [[5, 6], [7, 8, 9, 10]]


def test_engine_refuses_vllm_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    case = tmp_path / "case"
    case.mkdir()
    (case / "config.yaml").write_text(dump_yaml(from_dict({"name": "v", "rollout": {"backend": "vllm"}})))
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "rollout.backend: 'vllm' needs a CUDA GPU; use 'hf'" in res.stdout


def test_tensor_parallel_groups_share_their_prompts() -> None:
    """World 4, TP 2: ranks 0-1 get the first half of the prompts, ranks 2-3 the second; one copy of each group's
    output comes back, in prompt order. TP 1 is the plain per-rank split."""
    batch = {"input_ids": torch.arange(16).view(8, 2), "attention_mask": torch.ones(8, 2, dtype=torch.long)}
    shards = rollout_shards(batch, world=4, tp=2)
    assert len(shards) == 4
    assert torch.equal(shards[0]["input_ids"], batch["input_ids"][:4])
    assert torch.equal(shards[1]["input_ids"], batch["input_ids"][:4])
    assert torch.equal(shards[2]["input_ids"], batch["input_ids"][4:])
    assert torch.equal(shards[3]["input_ids"], shards[2]["input_ids"])
    echoed = [{"responses": s["input_ids"] * 10} for s in shards]  # what each rank of a group returns alike
    assert torch.equal(rollout_outputs(echoed, tp=2)["responses"], batch["input_ids"] * 10)
    echoed[3] = {"responses": echoed[3]["responses"] + 1}
    with pytest.raises(RuntimeError, match="ranks 2 and 3 generated different tokens"):
        rollout_outputs(echoed, tp=2)
    plain = rollout_shards(batch, world=4, tp=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(plain, shard(batch, 4), strict=True))
    assert torch.equal(rollout_outputs(plain, tp=1)["input_ids"], gather(shard(batch, 4))["input_ids"])


def test_engine_arguments_a_variant_can_replace() -> None:
    common = {"seed": 7, "gpu_memory_utilization": 0.3, "kv_cache_bytes": 1 << 30, "enforce_eager": False,
              "max_model_len": 768}
    base = engine_arguments("m", tensor_parallel_size=1, **common)
    assert base["enable_prefix_caching"] is True and base["enable_sleep_mode"] is True
    assert base["kv_cache_memory_bytes"] == 1 << 30 and base["tensor_parallel_size"] == 1
    assert base["logprobs_mode"] == "processed_logprobs"
    variant = engine_arguments("m", tensor_parallel_size=2, extra={"enable_prefix_caching": False, "block_size": 64},
                               **common)
    assert variant["enable_prefix_caching"] is False and variant["block_size"] == 64  # replaced, and added
    assert variant["distributed_executor_backend"] == "external_launcher"
    assert variant == {**base, **parallel_args(2), "enable_prefix_caching": False, "block_size": 64}


def test_model_runner_recorded_as_vllm_says() -> None:
    """The runner comes from vLLM's own config property (the GPU test checks a real engine's); a vLLM without it gives
    None, which the result leaves out rather than guessing."""
    from types import SimpleNamespace

    def engine(**config: bool) -> SimpleNamespace:
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(**config)))

    assert model_runner_of(engine(use_v2_model_runner=True)) == "v2"
    assert model_runner_of(engine(use_v2_model_runner=False)) == "v1"
    assert model_runner_of(engine()) is None and model_runner_of(object()) is None


def test_tensor_parallel_engine_arguments_and_config() -> None:
    assert parallel_args(1) == {"tensor_parallel_size": 1}
    tp2 = parallel_args(2)
    assert tp2["distributed_executor_backend"] == "external_launcher" and tp2["disable_custom_all_reduce"] is True
    assert tp2["tensor_parallel_size"] == 2
    four = {"trainer": {"world_size": 4}, "actor": {"micro_batch_size_per_gpu": 2},
            "critic": {"micro_batch_size_per_gpu": 2}, "rollout": {"backend": "vllm", "tensor_parallel_size": 2},
            "model": {"path": "qwen3-0.6b"}}
    assert from_dict(four).rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size: 2: vLLM 0.26 cannot shard the 64-wide tiny "
                                          r"model .*use 1, or a real model shape"):
        from_dict({**four, "model": {"path": "tiny"}})
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size: 3 does not divide trainer.world_size=2"):
        from_dict({"trainer": {"world_size": 2}, "rollout": {"backend": "vllm", "tensor_parallel_size": 3}})


def test_engine_refuses_tensor_parallel_hf(tmp_path: Path) -> None:
    """Asked of the hf backend, tensor parallelism is a config error; asked of `auto` where auto picks hf (no CUDA,
    no vLLM), the engine refuses it before anything starts."""
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size: shards a vLLM engine; the hf backend"):
        from_dict({"trainer": {"world_size": 2}, "rollout": {"backend": "hf", "tensor_parallel_size": 2}})
    case = tmp_path / "case"
    case.mkdir()
    cfg = {"name": "v", "trainer": {"world_size": 2}, "rollout": {"backend": "auto", "tensor_parallel_size": 2},
           "model": {"path": "qwen3-0.6b"}}
    (case / "config.yaml").write_text(dump_yaml(from_dict(cfg)))
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "rollout.tensor_parallel_size: only the vllm backend shards generation" in res.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_vllm_rollout(tmp_path: Path, tp: int) -> None:
    """Two GRPO steps with the vLLM backend on the GPUs (one engine per rank, or one per pair of ranks); rollout
    and actor log-probs agree closely. TP 2 runs the Qwen3-0.6B shape: vLLM 0.26 cannot shard the 64-wide tiny
    model over two GPUs (a kernel launch fails, or warm-up hangs, in `benchmarks/vllm_tp_probe.py` too)."""
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    case = tmp_path / "vllm"
    case.mkdir()
    cfg = {"name": "vllm", "algorithm": "grpo", "steps": 2, "model": {"path": "tiny" if tp == 1 else "qwen3-0.6b"},
           "rollout": {"backend": "vllm", "n": 4, "tensor_parallel_size": tp, "log_probs": True},
           "actor": {"micro_batch_size_per_gpu": 8}, "trainer": {"world_size": torch.cuda.device_count()},
           "zero": {"stage": 2}}
    (case / "config.yaml").write_text(dump_yaml(from_dict(cfg)))
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    result = json.loads((case / "result.json").read_text())
    assert result["rollout_backend"] == "vllm" and result["versions"]["vllm"]
    assert result["vllm_model_runner"] in ("v1", "v2")  # which one vLLM chose, recorded with the case
    last = json.loads((case / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["actor/rollout_logprob_diff/mean"] < 0.05


@pytest.mark.vllm
def test_log_probs_change_no_token() -> None:
    """`rollout.log_probs` only adds the sampled tokens' log-probs: the same prompts and seed sample the same tokens
    with and without them, another seed other tokens."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import AutoConfig

    from zbench.engine import vllm_rollout
    from zbench.engine.trainer import left_pad
    from zbench.engine.workers import special_ids
    from zbench.models import resolve_model

    # the fitted KV cache, as on the GPU by default: vLLM then skips its start-up memory profile, which fails when
    # another process on the GPU frees memory meanwhile
    cfg = from_dict({"algorithm": "grpo",
                     "rollout": {"backend": "vllm", "n": 4, "max_new_tokens": 24, "kv_cache_fit": True},
                     "actor": {"micro_batch_size_per_gpu": 8}, "trainer": {"world_size": 1}})
    path = str(resolve_model("tiny"))
    pad_id, eos_ids = special_ids(path)
    tied = bool(getattr(AutoConfig.from_pretrained(path), "tie_word_embeddings", False))
    rollout = vllm_rollout.build(path, cfg, pad_id, eos_ids, 0, tied)
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 9, 3, 7) * 8], pad_id)
    rollout.log_probs = True
    with_lp = rollout.generate(ids, mask, 5, sleep=False)
    rollout.log_probs = False
    without, other = (rollout.generate(ids, mask, seed, sleep=False) for seed in (5, 6))
    assert "rollout_log_probs" in with_lp and "rollout_log_probs" not in without
    assert torch.equal(with_lp["responses"], without["responses"])
    assert not torch.equal(without["responses"], other["responses"])
    # asleep (level 2: its weights dropped), the engine refuses to sample until a push has refilled them
    rollout.generate(ids, mask, 5)
    with pytest.raises(RuntimeError, match=r"push weights \(load_weights\), which wakes it, before generating"):
        rollout.generate(ids, mask, 5)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # pushed as the actor pushes: bf16, on GPU
    rollout.load_weights((name, t.detach().cuda()) for name, t in hf.named_parameters())
    assert torch.equal(rollout.generate(ids, mask, 5, sleep=False)["responses"], without["responses"])


def test_profile_benchmark_variant_env() -> None:
    """`benchmarks/vllm_profile.py`'s `"env"` variant key: the variables it sets before importing vLLM, as strings;
    anything but a mapping of names to strings or numbers is refused, naming the key."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_profile.py"
    spec = importlib.util.spec_from_file_location("vllm_profile_under_test", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # imports no vLLM at module level
    assert bench.variant_env({"name": "v1-runner", "env": {"VLLM_USE_V2_MODEL_RUNNER": "0", "X": 2}}) == \
        {"VLLM_USE_V2_MODEL_RUNNER": "0", "X": "2"}
    assert bench.variant_env({"name": "default"}) == {}
    for bad in (["VLLM_USE_V2_MODEL_RUNNER=0"], {"X": None}, {1: "0"}, {"X": True}):
        with pytest.raises(SystemExit, match='"env" must map variable names to strings or numbers'):
            bench.variant_env({"name": "bad", "env": bad})
    with pytest.raises(SystemExit, match='may not set VLLM_ENABLE_V1_MULTIPROCESSING; use "in_process": false'):
        bench.variant_env({"name": "bad", "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}})
