"""`model.compile_layers`: where it applies, how a case that cannot have it is refused, that ZeRO-3's leaf layers
(how a compiled layer keeps its gathers outside the graph) make the same update, and (on a GPU) that a compiled
update makes the update the eager one makes, at ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict
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


def test_zero3_leaf_layers_make_the_same_update():
    """One ZeRO-3 GRPO update of the same batch from the same weights, with DeepSpeed gathering per projection and
    per whole layer (leaf modules): the same statistics, log-probs and weights after the step (gradient
    checkpointing on, so a layer is gathered again for its recomputation)."""
    from test_lm_head import _full_params

    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-leaf-")
    cfg = from_dict(_cfg(zero={"stage": 3}, model={"gradient_checkpointing": True}))
    plain = PolicyWorker(cfg, 0, 1, case_dir, model_path)
    plain.join("127.0.0.1", free_port())
    plain.setup()
    leaf = _LeafLayers(cfg, 0, 1, case_dir, model_path)
    leaf.setup()
    assert leaf.leaves == len(leaf.engine.module.model.layers) > 0
    batch = _batch(pad_id=0)
    a, b = plain.update_actor(batch), leaf.update_actor(batch)
    assert torch.allclose(b.pop("old_log_probs"), a.pop("old_log_probs"), atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert a["actor/grad_norm"] > 0
    before, after = dict(_full_params(plain)), dict(_full_params(leaf))
    for name, p in before.items():
        assert torch.allclose(p, after[name], atol=1e-7), name


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
