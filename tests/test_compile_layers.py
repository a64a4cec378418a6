"""`model.compile_layers`: where it applies, how a case that cannot have it is refused, that ZeRO-3's leaf layers
(how a compiled layer keeps its gathers outside the graph) make the same update, and (on a GPU) that a compiled
update makes the update the eager one makes, at ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict, with_overrides
from zbench.engine import workers
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker, zero3_leaf_layers
from zbench.models import resolve_model


class _LeafLayers(PolicyWorker):
    """A worker whose decoder layers are ZeRO-3 leaf modules, as compiled layers make them, left eager (the CPU
    cannot compile): the leaf marking on its own, through the worker's real model build."""

    def _load(self, auto_cls, ds_config, **kwargs):  # type: ignore[no-untyped-def]
        model = super()._load(auto_cls, ds_config, **kwargs)
        self.leaves = zero3_leaf_layers(model, self._decoder_layers(model))
        return model


class _CompiledOnCpu(PolicyWorker):
    """A worker whose decoder layers are compiled as a CUDA case compiles them, through Dynamo and AOTAutograd
    (`aot_eager`: the same graphs, guards and saved tensors, with eager kernels in place of Inductor's, which the
    CPU does without); `graphs` counts the forward graphs Dynamo captured."""

    graphs = 0

    @staticmethod
    def counting(gm, example_inputs):  # type: ignore[no-untyped-def]
        # one backend for every compile, as "inductor" is one: Dynamo guards on which backend compiled a graph
        _CompiledOnCpu.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def _load(self, auto_cls, ds_config, **kwargs):  # type: ignore[no-untyped-def]
        model = super()._load(auto_cls, ds_config, **kwargs)
        self._compile_layers(model, backend=self.counting)
        return model


def test_auto_compiles_on_cuda_only():
    model = from_dict({}).model
    assert model.compile_layers == "auto"
    assert model.compiles_layers(on_cuda=True) and not model.compiles_layers(on_cuda=False)
    assert from_dict({"model": {"compile_layers": "always"}}).model.compiles_layers(on_cuda=True)
    assert not from_dict({"model": {"compile_layers": "never"}}).model.compiles_layers(on_cuda=True)
    with pytest.raises(ConfigError, match=re.escape("model.compile_layers: 'yes' is not one of 'auto', 'always', "
                                                    "'never'")):
        from_dict({"model": {"compile_layers": "yes"}})


def test_always_on_the_cpu_is_refused_by_name():
    worker = PolicyWorker(from_dict(_cfg(model={"compile_layers": "always"})), 0, 1,
                          tempfile.mkdtemp(prefix="zbench-compile-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    with pytest.raises(ConfigError, match=r"model\.compile_layers: 'always' compiles for CUDA only"):
        worker.setup()
    auto = PolicyWorker(from_dict(_cfg()), 0, 1, tempfile.mkdtemp(prefix="zbench-compile-"),
                        str(resolve_model("tiny")))
    assert auto.setup()["compiled_layers"] == 0  # auto on the CPU: eager, and the setup says so


def _zero3_updates(other: type[PolicyWorker], **twin: object) -> tuple[PolicyWorker, PolicyWorker, dict, dict]:
    """A plain ZeRO-3 worker and one of class `other` (checkpointing on, the same initial weights; `twin` config
    overrides on the second only), and what one GRPO update of the same batch returned on each."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-z3-")
    cfg = from_dict(_cfg(zero={"stage": 3}, model={"gradient_checkpointing": True}))
    plain = PolicyWorker(cfg, 0, 1, case_dir, model_path)
    plain.join("127.0.0.1", free_port())
    plain.setup()
    twin = other(with_overrides(cfg, twin), 0, 1, case_dir, model_path)
    twin.setup()
    batch = _batch(pad_id=0)
    return plain, twin, plain.update_actor(batch), twin.update_actor(batch)


def test_zero3_leaf_layers_make_the_same_update():
    """One ZeRO-3 GRPO update of the same batch from the same weights, with DeepSpeed gathering per projection and
    per whole layer (leaf modules): the same statistics, log-probs and weights after the step (gradient
    checkpointing on, so a layer is gathered again for its recomputation)."""
    from test_lm_head import _full_params

    plain, leaf, a, b = _zero3_updates(_LeafLayers)
    assert leaf.leaves == len(leaf.engine.module.model.layers) > 0
    assert torch.allclose(b.pop("old_log_probs"), a.pop("old_log_probs"), atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert a["actor/grad_norm"] > 0
    before, after = dict(_full_params(plain)), dict(_full_params(leaf))
    for name, p in before.items():
        assert torch.allclose(p, after[name], atol=1e-7), name


def test_zero3_compiled_layers_share_one_graph_and_make_the_eager_update(monkeypatch):
    """ZeRO-3's compiled leaf layers: every layer runs the graph Dynamo captures for the first, and the update
    equals the eager one. The guards on DeepSpeed's parameter numbers are dropped, and only those: PyTorch 2.11
    guards each number's value, so every layer compiled its own graph (on a 28-layer model, past Dynamo's
    recompile limit, the rest ran eager); this PyTorch guards only its type, which the filter drops as well."""
    seen: list[tuple[str, bool]] = []
    real = workers.skip_zero3_param_ids

    def recording(guards):  # type: ignore[no-untyped-def]
        kept = real(guards)
        seen.extend((g.name, k) for g, k in zip(guards, kept, strict=True))
        return kept

    torch._dynamo.reset()
    monkeypatch.setattr(workers, "skip_zero3_param_ids", recording)
    _CompiledOnCpu.graphs = 0
    _, compiled, a, b = _zero3_updates(_CompiledOnCpu)
    assert compiled.compiled_layers == len(compiled.engine.module.model.layers) == 2
    # one graph for the training forward (recomputed in the backward under checkpointing), one for the gradient-free
    # log-prob pass: not one per layer
    assert _CompiledOnCpu.graphs == 2
    dropped = {name for name, kept in seen if not kept}
    assert dropped and all(name.endswith(".ds_id") for name in dropped)
    assert any(kept for _, kept in seen)
    assert torch.allclose(b.pop("old_log_probs"), a.pop("old_log_probs"), atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers run on CUDA only")
@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_update_equals_the_eager_one_on_cuda(stage: int):
    """One GRPO update of the same batch from the same weights, layers compiled and eager (float32, so the
    comparison is not lost in bf16 rounding): the same statistics and returned log-probs."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-compile-")
    results = []
    for mode in ("never", "always"):
        cfg = from_dict(_cfg(trainer={"device": "cuda"}, zero={"stage": stage}, model={"compile_layers": mode}))
        worker = PolicyWorker(cfg, 0, 1, case_dir, model_path)
        worker.join("127.0.0.1", free_port())
        info = worker.setup()
        assert info["compiled_layers"] == (0 if mode == "never" else len(worker.engine.module.model.layers))
        results.append(worker.update_actor(_batch(pad_id=0)))
    eager, compiled = results
    assert torch.allclose(compiled.pop("old_log_probs"), eager.pop("old_log_probs"), atol=1e-4)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-5), key


def test_zero3_compiled_layers_with_fewer_checkpointed_make_the_eager_update():
    """`model.checkpoint_layers=1` on ZeRO-3's compiled leaf layers: the first layer recomputes, the second keeps its
    activations, each runs the graph captured for its own checkpointing, and the update equals the eager one with
    every layer checkpointed."""
    torch._dynamo.reset()
    _CompiledOnCpu.graphs = 0
    _, fewer, a, b = _zero3_updates(_CompiledOnCpu, **{"model.checkpoint_layers": 1})
    layers = fewer.engine.module.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert _CompiledOnCpu.graphs == 3  # training forward with and without checkpointing, and the log-prob pass
    assert torch.allclose(b.pop("old_log_probs"), a.pop("old_log_probs"), atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    torch._dynamo.reset()
