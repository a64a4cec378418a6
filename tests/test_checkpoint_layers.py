"""`model.checkpoint_layers`: activation checkpointing on the first N decoder layers only. The layers past N keep
their activations, the update is the same (real DeepSpeed on CPU, the embedded tiny model), the memory estimate
sits between full and no checkpointing, and bad values are refused by name."""

from __future__ import annotations

import re
import tempfile

import pytest
from test_old_log_prob import _batch, _cfg, assert_same_update

from zbench.analyze.activations import geometry_memory
from zbench.config import ConfigError, from_dict, with_overrides
from zbench.engine.cluster import free_port
from zbench.engine.workers import PolicyWorker
from zbench.models import resolve_model


def _update(model: dict) -> tuple[PolicyWorker, dict]:
    """A ZeRO-2 worker built with `model` settings (the same initial weights every time) and one GRPO update."""
    cfg = from_dict(_cfg(zero={"stage": 2}, model=model))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-ckpt-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    worker.setup()
    return worker, worker.update_actor(_batch(pad_id=0))


def test_partial_checkpointing_makes_the_same_update():
    full_worker, full = _update({"gradient_checkpointing": True})
    part_worker, part = _update({"gradient_checkpointing": True, "checkpoint_layers": 1})
    _, none = _update({"gradient_checkpointing": False})
    layers = part_worker.engine.module.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert all(layer.gradient_checkpointing for layer in full_worker.engine.module.model.layers)
    assert_same_update(full, none)
    assert_same_update(full, part, (full_worker.engine.module.named_parameters(), part_worker.engine.module.parameters()))


def test_bad_values_are_refused_by_name():
    with pytest.raises(ConfigError, match=re.escape("model.checkpoint_layers: 4 layers checkpointed needs "
                                                    "model.gradient_checkpointing=true")):
        from_dict({"model": {"checkpoint_layers": 4}})
    with pytest.raises(ConfigError, match=re.escape("model.checkpoint_layers: must be >= 0, got -1")):
        from_dict({"model": {"gradient_checkpointing": True, "checkpoint_layers": -1}})
    cfg = from_dict(_cfg(model={"gradient_checkpointing": True, "checkpoint_layers": 3}))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-ckpt-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    with pytest.raises(ConfigError, match=r"model\.checkpoint_layers: 3 is more than the 2 decoder layers of .*; "
                                          r"at most 2, or null"):
        worker.setup()


def test_memory_estimate_falls_between_full_and_none():
    base = from_dict({"model": {"path": "qwen3-0.6b"}, "trainer": {"device": "cuda"},
                      "actor": {"micro_batch_size_per_gpu": 4}})

    def training_gb(**model: object) -> float:
        over = {f"model.{k}": v for k, v in model.items()}
        return geometry_memory(with_overrides(base, over), True, 141 * 2**30).training / 2**30

    full, none = training_gb(gradient_checkpointing=True), training_gb(gradient_checkpointing=False)
    half = training_gb(gradient_checkpointing=True, checkpoint_layers=14)
    assert training_gb(gradient_checkpointing=True, checkpoint_layers=28) == full
    assert full < half < none
    # each layer that keeps its activations adds the same amount
    quarter = training_gb(gradient_checkpointing=True, checkpoint_layers=21)
    assert half - quarter == pytest.approx(quarter - full, rel=1e-6)


REFERENCE = [("model.path", "qwen3-0.6b"), ("trainer.world_size", 2), ("trainer.device", "cuda"),
             ("data.max_prompt_length", 512), ("trainer.train_batch_size", 64), ("actor.ppo_mini_batch_size", 64),
             ("rollout.max_new_tokens", 512), ("rollout.backend", "vllm")]


EAGER = ("model.compile_layers", "never")


def test_gpu_defaults_keep_activations_where_the_peak_does_not_rise():
    """At the reference config with eager layers, GRPO's rollout holds a KV cache for 128 sequences per GPU: the
    update may keep the activations of a few layers in that memory (vLLM sleeps while it trains) without raising
    the predicted peak. PPO's cache (32 sequences) leaves no room. Anything named is left alone."""
    from zbench.harness.matrix import expand, load_matrix

    def chosen(matrix: str, *sets: tuple[str, object]) -> dict[str, object]:
        return {c.name: c.device_defaults.get("model.checkpoint_layers", "unset")
                for c in expand(load_matrix(matrix), sets=[*REFERENCE, EAGER, *sets], device_defaults=True)}

    grpo = chosen("grpo-six-case")
    for name, keep in grpo.items():
        case = next(c for c in expand(load_matrix("grpo-six-case"), sets=[*REFERENCE, EAGER], device_defaults=True)
                    if c.name == name)
        full = geometry_memory(with_overrides(case.config, {"model.checkpoint_layers": None}), True, 0)
        fewer = geometry_memory(case.config, True, 0)
        assert isinstance(keep, int) and 0 < keep < 28, name
        assert fewer.peak_bytes <= full.peak_bytes and fewer.training > full.training, name
        one_less = geometry_memory(with_overrides(case.config, {"model.checkpoint_layers": keep - 1}), True, 0)
        assert one_less.peak_bytes > full.peak_bytes, name  # the fewest that keep the peak
    assert set(chosen("six-case").values()) == {"unset"}
    assert set(chosen("grpo-six-case", ("model.gradient_checkpointing", True)).values()) == {"unset"}
    assert set(chosen("grpo-six-case", ("rollout.gpu_memory_utilization", 0.3)).values()) == {"unset"}
    with pytest.raises(ConfigError, match=r"model.path '/nonexistent/model': /nonexistent/model is not a directory; "
                                          r"give 'tiny', .* \(a GPU case reads its model's shape"):
        chosen("grpo-six-case", ("model.path", "/nonexistent/model"))


def test_gpu_defaults_of_compiled_layers_take_the_largest_activation_budget_within_the_peak():
    """Compiled layers (a GPU's default) checkpoint none: each keeps the largest share of its activations
    (`model.activation_memory_budget`, a multiple of 0.05) predicted to leave the case's peak where checkpointing
    every layer puts it. GRPO's KV cache for 128 sequences a GPU leaves room for a share; PPO's for 32 leaves none
    (a budget of 0 keeps what checkpointing keeps). A named budget is kept and still turns checkpointing off; named
    checkpointing keeps the layers as it says."""
    from zbench.harness.matrix import expand, load_matrix

    def cases(matrix: str, *sets: tuple[str, object], globs: tuple[str, ...] = ()) -> list:
        return expand(load_matrix(matrix), sets=[*REFERENCE, *sets], case_globs=list(globs), device_defaults=True)

    for case in cases("grpo-six-case"):
        budget = case.device_defaults["model.activation_memory_budget"]
        assert case.device_defaults["model.gradient_checkpointing"] is False, case.name
        assert "model.checkpoint_layers" not in case.device_defaults, case.name
        assert 0 <= budget <= 1 and round(budget / 0.05, 6).is_integer(), case.name
        every = with_overrides(case.config, {"model.gradient_checkpointing": True,
                                             "model.activation_memory_budget": 1.0})
        ceiling = geometry_memory(every, True, 0).peak_bytes
        assert geometry_memory(case.config, True, 0).peak_bytes <= ceiling, case.name
        if budget < 1:  # the next step up would raise the peak
            more = with_overrides(case.config, {"model.activation_memory_budget": round(budget + 0.05, 2)})
            assert geometry_memory(more, True, 0).peak_bytes > ceiling, case.name
    [z2] = cases("grpo-six-case", globs=("zero2_no_offload",))
    assert z2.device_defaults["model.activation_memory_budget"] > 0  # room in the sleeping KV cache's memory
    # `zbench estimate`'s micro-batch without checkpointing keeps every activation, whatever the case's budget
    from zbench.analyze.activations import largest_fitting_micro

    keep_all = with_overrides(z2.config, {"model.activation_memory_budget": 1.0})
    assert largest_fitting_micro(z2.config, False, 40 * 2**30) == largest_fitting_micro(keep_all, False, 40 * 2**30)
    for case in cases("six-case"):
        assert case.device_defaults["model.activation_memory_budget"] == 0.0, case.name
        every = with_overrides(case.config, {"model.gradient_checkpointing": True})
        assert geometry_memory(case.config, True, 0).peak_bytes == geometry_memory(every, True, 0).peak_bytes
    for case in cases("grpo-six-case", ("model.activation_memory_budget", 0.3)):
        assert case.config.model.activation_memory_budget == 0.3 and not case.config.model.gradient_checkpointing
        assert "model.activation_memory_budget" not in case.device_defaults
    # a named budget of 1 keeps all a layer does not checkpoint: checkpointing's defaults stand, as for eager layers
    for case in cases("grpo-six-case", ("model.activation_memory_budget", 1.0)):
        assert case.config.model.gradient_checkpointing, case.name
    for case in cases("grpo-six-case", ("model.gradient_checkpointing", True)):
        assert case.config.model.gradient_checkpointing and case.config.model.activation_memory_budget == 1.0
    for case in cases("grpo-six-case", ("rollout.gpu_memory_utilization", 0.3)):  # a KV cache not sized here
        assert case.device_defaults["model.activation_memory_budget"] == 0.0


def test_a_budget_needs_compiled_layers():
    """A budget below 1 shares a compiled layer's activations: refused by name where no layer compiles, by the
    config itself for `compile_layers=never`, by the worker as it builds its model on the CPU (where `auto`
    compiles none), before any step."""
    with pytest.raises(ConfigError, match=re.escape("model.activation_memory_budget: 1.5 is not a share")):
        from_dict({"model": {"activation_memory_budget": 1.5}})
    with pytest.raises(ConfigError, match=r"model\.activation_memory_budget: 0\.5 .* model\.compile_layers=never compiles none"):
        from_dict({"model": {"activation_memory_budget": 0.5, "compile_layers": "never"}})
    cfg = from_dict(_cfg(model={"activation_memory_budget": 0.5}))
    worker = PolicyWorker(cfg, 0, 1, tempfile.mkdtemp(prefix="zbench-budget-"), str(resolve_model("tiny")))
    worker.join("127.0.0.1", free_port())
    with pytest.raises(ConfigError, match=r"model\.activation_memory_budget: 0\.5 .* are not compiled \(model\."
                                          r"compile_layers=auto compiles on CUDA only\)"):
        worker.setup()


def test_tune_trials_override_the_default_layer_count():
    """A tune trial of a GPU case sets the layer count with the checkpointing it tries: a trial without checkpointing
    is not refused for the count the GPU defaults chose, and one with checkpointing on every layer says so."""
    from zbench.harness.matrix import expand, load_matrix
    from zbench.harness.tune import TUNE_BUDGETS, case_space
    from zbench.harness.tune_search import Geometry

    [case] = expand(load_matrix("grpo-six-case"), sets=[*REFERENCE, EAGER], case_globs=["zero2_no_offload"],
                    device_defaults=True)
    assert case.config.model.checkpoint_layers == 24
    tune = case_space(case, budget_gb=28.0, on_cuda=True, device_bytes=141 * 2**30)
    assert tune.search.space.num_layers == 28
    plain = with_overrides(case.config, tune.overrides(Geometry(32, 0, False)))
    assert not plain.model.gradient_checkpointing and plain.model.checkpoint_layers is None
    every = with_overrides(case.config, tune.overrides(Geometry(32, 0, True)))
    assert every.model.gradient_checkpointing and every.model.checkpoint_layers is None
    assert with_overrides(case.config, tune.overrides(Geometry(32, 0, True, 20))).model.checkpoint_layers == 20
    assert tune.search.space.budgets == ()  # eager layers: no activation budget to tune
    # compiled layers (the default): the budget is a knob of its own, starting from the one the defaults chose
    [case] = expand(load_matrix("grpo-six-case"), sets=REFERENCE, case_globs=["zero2_no_offload"],
                    device_defaults=True)
    tune = case_space(case, budget_gb=28.0, on_cuda=True, device_bytes=141 * 2**30)
    assert tune.search.space.budgets == TUNE_BUDGETS
    assert tune.search.space.start == Geometry(32, 0, False, activation_budget=case.config.model.activation_memory_budget)
    lean = with_overrides(case.config, tune.overrides(Geometry(32, 0, False, activation_budget=0.3)))
    assert lean.model.activation_memory_budget == 0.3 and not lean.model.gradient_checkpointing
    fixed = expand(load_matrix("grpo-six-case"), sets=[*REFERENCE, ("model.activation_memory_budget", 0.5)],
                   case_globs=["zero2_no_offload"], device_defaults=True)[0]
    assert case_space(fixed, budget_gb=28.0, on_cuda=True, device_bytes=141 * 2**30).search.space.budgets == ()


def test_estimate_of_a_gpu_matrix_whose_defaults_checkpoint_fewer_layers():
    """`zbench estimate` sizes the micro-batches that fit with and without checkpointing for a case whose GPU
    defaults chose a layer count: the count does not clash with the geometry without checkpointing."""
    from typer.testing import CliRunner

    from zbench.cli import app

    sets = [a for key, value in REFERENCE if key != "trainer.device" for a in ("--set", f"{key}={value}")]
    res = CliRunner().invoke(app, ["estimate", "grpo-six-case", "--device", "cuda", "--device-memory", "141",
                                   "--cases", "zero2_no_offload", *sets])
    assert res.exit_code == 0, res.output
    row = res.output.splitlines()[1].split()
    assert row[0] == "zero2_no_offload" and row[-3] == "yes" and int(row[-1]) >= int(row[-2]) > 0
