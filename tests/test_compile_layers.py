"""`model.compile_layers`: where it applies, how a case that cannot have it is refused, and (on a GPU) that a
compiled update makes the update the eager one makes."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from test_old_log_prob import _batch, _cfg

from zbench.config import ConfigError, from_dict
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def test_auto_compiles_on_cuda_below_zero3_only():
    model = from_dict({}).model
    assert model.compile_layers == "auto"
    assert model.compiles_layers(2, on_cuda=True) and model.compiles_layers(0, on_cuda=True)
    assert not model.compiles_layers(3, on_cuda=True)  # measured no faster at ZeRO-3
    assert not model.compiles_layers(2, on_cuda=False)
    always = from_dict({"model": {"compile_layers": "always"}}).model
    assert always.compiles_layers(3, on_cuda=True)
    assert not from_dict({"model": {"compile_layers": "never"}}).model.compiles_layers(1, on_cuda=True)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layers run on CUDA only")
def test_compiled_update_equals_the_eager_one_on_cuda():
    """One ZeRO-2 GRPO update of the same batch from the same weights, layers compiled and eager (float32, so the
    comparison is not lost in bf16 rounding): the same statistics and returned log-probs."""
    model_path = str(resolve_model("tiny"))
    case_dir = tempfile.mkdtemp(prefix="zbench-compile-")
    results = []
    for mode in ("never", "always"):
        cfg = from_dict(_cfg(trainer={"device": "cuda"}, zero={"stage": 2}, model={"compile_layers": mode}))
        worker = PolicyWorker(cfg, 0, 1, case_dir, model_path)
        worker.join("127.0.0.1", free_port())
        info = worker.setup()
        assert info["compiled_layers"] == (0 if mode == "never" else len(worker.engine.module.model.layers))
        results.append(worker.update_actor(_batch(pad_id=0)))
    eager, compiled = results
    assert torch.allclose(compiled.pop("old_log_probs"), eager.pop("old_log_probs"), atol=1e-4)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-5), key
