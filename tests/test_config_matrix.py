"""Config tree and matrix expansion: names, precedence, excludes, and every bad input with its message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zbench.config import (
    GRAPH_STEPS_PER_GRAPH,
    ConfigError,
    as_recorded,
    auto_takes_graph_loop,
    critic_overlap_faster,
    dump_yaml,
    effective_offload,
    from_dict,
    graph_loop_measured,
    kv_cache_released,
    load_case_config,
    parse_set,
    replica_parks,
    rollout_engine,
    with_overrides,
)
from zbench.harness.matrix import expand, load_matrix, shipped_matrices

SIX = ["zero1_no_offload", "zero2_no_offload", "zero3_no_offload",
       "zero1_cpu_offload", "zero2_cpu_offload", "zero3_cpu_offload"]


def write(tmp_path: Path, text: str, name: str = "m.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_shipped_matrices_expand() -> None:
    counts = {name: len(expand(load_matrix(name))) for name in shipped_matrices()}
    assert counts == {"ddp-vs-zero": 12, "grpo-six-case": 6, "seed-gate": 6, "six-case": 6, "twelve-case": 12,
                      "zero-nvme": 2}
    six = expand(load_matrix("six-case"), seed=7777, steps=60)
    assert [c.name for c in six] == SIX
    assert [(c.config.zero.stage, c.config.zero.offload) for c in six] == [
        (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu")]
    assert all(c.config.algorithm == "ppo" and c.config.seed == 7777 and c.config.steps == 60 for c in six)
    grpo = expand(load_matrix("grpo-six-case"))
    assert [c.name for c in grpo] == SIX and all(c.config.rollout.n == 4 for c in grpo)
    twelve = [c.name for c in expand(load_matrix("twelve-case"))]
    assert twelve[:2] == ["ppo_zero1_no_offload", "ppo_zero2_no_offload"] and twelve[-1] == "grpo_zero3_cpu_offload"
    ddp = expand(load_matrix("ddp-vs-zero"))
    assert ddp[0].name == "zero0_no_ac" and ddp[1].config.model.gradient_checkpointing
    # a matrix axis that sets the seed wins over the run's --seed
    assert [c.config.seed for c in expand(load_matrix("seed-gate"), seed=9)][:3] == [1, 2, 3]


def test_overrides_apply_to_every_case_last() -> None:
    cases = expand(load_matrix("six-case"), sets=[("rollout.max_new_tokens", 16), ("actor.lr", 2e-5)])
    assert {c.config.rollout.max_new_tokens for c in cases} == {16} and {c.config.actor.lr for c in cases} == {2e-5}
    assert cases[0].overrides["rollout.max_new_tokens"] == 16
    assert parse_set("actor.lr=1e-4") == ("actor.lr", "1e-4")  # YAML 1.1 reads this as a string ...
    assert expand(load_matrix("six-case"), sets=[parse_set("actor.lr=1e-4")])[0].config.actor.lr == 1e-4  # ... coerced


def test_excludes_cases_and_globs(tmp_path: Path) -> None:
    path = write(tmp_path, """
description: t
axes:
  stage: {zero1: {zero.stage: 1}, zero3: {zero.stage: 3}}
  offload: {none: {zero.offload: none}, cpu: {zero.offload: cpu}}
name: "{stage}-{offload}"
exclude: [{stage: zero1, offload: cpu}, "zero3-n*"]
cases: [{name: ddp, set: {zero.stage: 0}}]
""")
    m = load_matrix(path)
    assert [c.name for c in expand(m)] == ["zero1-none", "zero3-cpu", "ddp"]
    assert [c.name for c in expand(m, case_globs=["dd*"])] == ["ddp"]
    with pytest.raises(ConfigError, match=r"--cases nope matches none of zero1-none, zero3-cpu, ddp"):
        expand(m, case_globs=["nope"])


def test_round_trip_and_effective_offload(tmp_path: Path) -> None:
    cfg = expand(load_matrix("six-case"), seed=3, steps=5)[5].config
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_case_config(path) == cfg
    assert effective_offload(1, "cpu").label == "optimizer:cpu"
    assert effective_offload(2, "nvme").label == "optimizer:cpu"  # DeepSpeed's ZeRO-2 keeps offload in CPU memory
    assert effective_offload(3, "nvme").label == "optimizer+params:nvme"
    assert effective_offload(3, "auto").label == "optimizer+params:cpu"
    assert effective_offload(0, "auto").label == "none"


@pytest.mark.parametrize(("text", "message"), [
    ("base: {zero: {stage: 5}}\naxes: {a: {x: {}}}\n", r"zero.stage: 5 is not one of 0, 1, 2, 3"),
    ("base: {zero: {stge: 2}}\naxes: {a: {x: {}}}\n", r"zero.stge: unknown key; did you mean 'stage'\?"),
    ("base: {rollout: {n: two}}\naxes: {a: {x: {}}}\n", r"rollout.n: expected an integer, got 'two'"),
    ("base: {model: {gradient_checkpointing: 1}}\naxes: {a: {x: {}}}\n",
     r"model.gradient_checkpointing: expected true or false, got 1"),
    ("axes: {a: {x: {zero.offlod: cpu}}}\n", r"zero.offlod: unknown key; did you mean 'offload'\?"),
    ("axis: {a: {x: {}}}\n", r"axis: unknown matrix key; did you mean 'axes'\?"),
    ("axes: {a: {x: {}}}\nname: '{b}'\n", r"template '\{b\}' uses \['b'\], not axes of this matrix"),
    ("axes: {a: {'../x': {}}}\n", r"invalid case name '\.\./x': use 1-128 characters"),
    ("axes: {a: {x: {zero.stage: 0, zero.offload: cpu}}}\n", r"stage 0 \(DDP\) has no ZeRO-partitioned state"),
    ("base: {algorithm: grpo}\naxes: {a: {x: {}}}\n", r"rollout.n: the grpo estimator compares samples within a group"),
    ("base: {trainer: {world_size: 3}}\naxes: {a: {x: {}}}\n", r"cannot be split into micro-batches of 4 on each of 3"),
    ("axes: [1, 2\n", r"malformed YAML: line 2, column 1"),
])
def test_bad_matrix_messages_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as err:
        expand(load_matrix(path))
    assert path in str(err.value)


def test_unknown_matrix_suggests() -> None:
    with pytest.raises(ConfigError, match=r"unknown matrix 'six-cases': did you mean 'six-case'\?"):
        load_matrix("six-cases")


def test_bad_case_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "zero:\n  stage: 2\n  offload: disk\n", "config.yaml")
    with pytest.raises(ConfigError, match=r"config.yaml: zero.offload: 'disk' is not one of 'none', 'cpu'"):
        load_case_config(path)
    with pytest.raises(ConfigError, match=r"expected a mapping of ZeroConfig fields"):
        from_dict({"zero": 3})


def zbench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_cli_reports_bad_input_without_traceback(tmp_path: Path) -> None:
    res = zbench("run", "six-case", "--steps", "1", "--set", "zero.stag=2", "--dry-run")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--set: zero.stag: unknown key; did you mean 'stage'?" in res.stderr
    res = zbench("run", "six-case", "--steps", "1", "--tag", "../escape", "--results-dir", str(tmp_path))
    assert res.returncode == 2 and "invalid tag '../escape'" in res.stderr
    assert not any(tmp_path.iterdir())  # nothing created
    res = zbench("run", "sixcase", "--dry-run")
    assert res.returncode == 2 and "did you mean 'six-case'?" in res.stderr
    res = zbench("run", "six-case", "--steps", "1", "--dry-run")
    assert res.returncode == 0 and res.stdout.splitlines()[0].startswith("zero1_no_offload\t")
    res = zbench("resume", str(tmp_path / "missing"))
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_adv_estimator_decides_the_critic() -> None:
    """`algo.adv_estimator` picks the estimator; only GAE trains a critic (and splits its micro-batches)."""
    assert from_dict({"algorithm": "ppo"}).adv_estimator == "gae" and from_dict({"algorithm": "ppo"}).needs_critic
    grpo = from_dict({"algorithm": "grpo", "rollout": {"n": 4}})
    assert grpo.adv_estimator == "grpo" and not grpo.needs_critic
    rloo = from_dict({"algorithm": "ppo", "algo": {"adv_estimator": "rloo"}, "rollout": {"n": 2}})
    assert rloo.adv_estimator == "rloo" and not rloo.needs_critic and "critic" not in rloo.batch_plan().grad_accum
    with pytest.raises(ConfigError, match=r"rollout.n: the rloo estimator compares samples within a group"):
        from_dict({"algo": {"adv_estimator": "rloo"}})
    with pytest.raises(ConfigError, match=r"algo.adv_estimator: 'vtrace' is not one of 'auto', 'gae', 'grpo', 'rloo'"):
        from_dict({"algo": {"adv_estimator": "vtrace"}})


def test_decode_attention_belongs_to_the_graph_loop() -> None:
    """`rollout.decode_attention` chooses the hf graph loop's attention: named elsewhere it is an error, not a no-op."""
    graph = {"backend": "hf", "cuda_graph": True}
    assert from_dict({"rollout": graph | {"decode_attention": "sdpa"}}).rollout.decode_attention == "sdpa"
    assert from_dict({}).rollout.decode_attention == "auto"
    with pytest.raises(ConfigError, match=r"rollout.decode_attention: 'triton' chooses the attention of the hf "
                                          r"backend's graph loop: set rollout.cuda_graph=true"):
        from_dict({"rollout": {"decode_attention": "triton"}})
    with pytest.raises(ConfigError, match=r"rollout.decode_attention: 'sdpa' chooses"):
        from_dict({"rollout": {"backend": "vllm", "decode_attention": "sdpa"}})
    with pytest.raises(ConfigError, match=r"rollout.decode_attention: 'flash' is not one of 'auto', 'triton', 'sdpa'"):
        from_dict({"rollout": graph | {"decode_attention": "flash"}})


def test_steps_per_graph_belongs_to_the_graph_loop() -> None:
    """`rollout.steps_per_graph` captures the hf graph loop's steps: at least 1, and above 1 only with that loop."""
    graph = {"backend": "hf", "cuda_graph": True}
    assert from_dict({"rollout": graph | {"steps_per_graph": 8}}).rollout.steps_per_graph == 8
    assert from_dict({}).rollout.steps_per_graph == 1
    with pytest.raises(ConfigError, match=r"rollout.steps_per_graph: 8 captures the hf backend's graph loop: set "
                                          r"rollout.cuda_graph=true"):
        from_dict({"rollout": {"backend": "hf", "steps_per_graph": 8}})
    with pytest.raises(ConfigError, match=r"rollout.steps_per_graph: 8 captures the hf backend's graph loop, which "
                                          r"vllm does not run: set rollout.backend=hf"):
        from_dict({"rollout": {"backend": "vllm", "steps_per_graph": 8}})
    with pytest.raises(ConfigError, match=r"needs top_p 1 \(rollout.top_p is 0.9\)"):
        from_dict({"rollout": graph | {"steps_per_graph": 8, "top_p": 0.9}})
    with pytest.raises(ConfigError, match=r"rollout.steps_per_graph"):
        from_dict({"rollout": graph | {"steps_per_graph": 0}})
    # on a GPU, naming it asks for the graph loop, as naming its attention does
    cuda = expand(load_matrix("grpo-six-case"), sets=[("rollout.steps_per_graph", 8)], case_globs=["zero2_*"],
                  device_defaults=True, on_cuda=True)
    assert cuda and all(c.config.rollout.cuda_graph and c.config.rollout.steps_per_graph == 8 for c in cuda)


def test_compile_prefill_belongs_to_the_graph_loop() -> None:
    """`rollout.compile_prefill` says how the hf graph loop prefills: on by default; old case configs read it as the
    eager prefill they ran; on a GPU, turning it off leaves the choice of the loop to the defaults (the loop where it
    has run fast, else not)."""
    graph = {"backend": "hf", "cuda_graph": True}
    assert from_dict({}).rollout.compile_prefill is True
    assert from_dict({"rollout": graph | {"compile_prefill": False}}).rollout.compile_prefill is False
    assert from_dict(as_recorded({"rollout": graph})).rollout.compile_prefill is False
    plain = expand(load_matrix("grpo-six-case"), case_globs=["zero2_*"], device_defaults=True, on_cuda=True)
    off = expand(load_matrix("grpo-six-case"), sets=[("rollout.compile_prefill", False)], case_globs=["zero2_*"],
                 device_defaults=True, on_cuda=True)
    assert [c.config.rollout.cuda_graph for c in off] == [c.config.rollout.cuda_graph for c in plain]
    assert any(c.config.rollout.cuda_graph for c in off) and not any(c.config.rollout.compile_prefill for c in off)


def test_gpu_graph_loop_cases_capture_four_steps_a_graph_unless_named() -> None:
    """On CUDA a case whose graph loop records its decode steps and draws in them (top_p 1, the replica kept on the
    GPU) takes `rollout.steps_per_graph` = GRAPH_STEPS_PER_GRAPH; the eager loop of a parked replica, a top_p below
    1, vLLM and the CPU keep 1, and a named value stands."""
    ref = [("trainer.device", "cuda"), ("trainer.world_size", 2), ("trainer.train_batch_size", 64),
           ("actor.ppo_mini_batch_size", 64), ("rollout.max_new_tokens", 512), ("data.max_prompt_length", 512),
           ("model.path", "qwen3-0.6b")]

    def steps(*sets: tuple[str, object], matrix: str = "grpo-six-case") -> dict[str, int]:
        cases = expand(load_matrix(matrix), sets=[*ref, *sets], device_defaults=True)
        named = "rollout.steps_per_graph" in dict(sets)
        for c in cases:
            if named:  # a named value is never a default
                assert "rollout.steps_per_graph" not in c.device_defaults, c.name
            else:  # what the config runs is what the defaults say they set
                assert c.config.rollout.steps_per_graph == c.device_defaults.get("rollout.steps_per_graph", 1), c.name
        return {c.name: c.config.rollout.steps_per_graph for c in cases}

    assert GRAPH_STEPS_PER_GRAPH > 1
    grpo = steps()
    assert {n for n, k in grpo.items() if k == GRAPH_STEPS_PER_GRAPH} == {"zero1_no_offload", "zero2_no_offload",
                                                                          "zero3_no_offload"}
    assert {n for n, k in grpo.items() if k != GRAPH_STEPS_PER_GRAPH} == {n for n in grpo if "cpu_offload" in n}
    assert all(k == 1 for k in grpo.values() if k != GRAPH_STEPS_PER_GRAPH)
    ppo = steps(matrix="six-case")  # PPO's loop where it was measured: ZeRO-1/2 without offload
    assert {n for n, k in ppo.items() if k == GRAPH_STEPS_PER_GRAPH} == {"zero1_no_offload", "zero2_no_offload"}
    # the loop asked for on a parked replica runs eagerly, a step at a time: no default claims more
    parked = steps(("rollout.cuda_graph", True))
    assert all(k == 1 for n, k in parked.items() if "cpu_offload" in n)
    assert set(steps(("rollout.top_p", 0.9)).values()) == {1}  # the draw between steps: one step a replay
    assert set(steps(("rollout.backend", "vllm")).values()) == {1}
    # auto where it samples with vLLM, the loop named or not: 1; where it takes the loop: the loop's default
    assert set(steps(("rollout.backend", "auto"), ("rollout.release_kv_cache", False)).values()) == {1}
    assert set(steps(("rollout.backend", "auto"), ("rollout.cuda_graph", True), ("trainer.world_size", 1)).values()) \
        == {1}
    assert steps(("rollout.backend", "auto"))["zero2_no_offload"] == GRAPH_STEPS_PER_GRAPH
    assert set(steps(("rollout.steps_per_graph", 2)).values()) == {2}  # named: the loop on everywhere, at 2
    cpu = expand(load_matrix("grpo-six-case"), sets=[("trainer.device", "cpu")], device_defaults=True)
    assert all(c.config.rollout.steps_per_graph == 1 for c in cpu)


def test_set_on_a_key_a_case_name_stands_for_is_refused(tmp_path: Path) -> None:
    """`--set zero.stage=3` on six-case would run six stage-3 cases named zero1_…, zero2_…: refused, naming the
    axis and the --cases glob that picks the cases already at that value; the same key on the chosen cases only
    (all already at that value) passes."""
    res = zbench("show", "six-case", "--set", "zero.stage=3")
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == ""
    assert "--set zero.stage=3: the matrix's axis 'stage' sets zero.stage (zero1: 1, zero2: 2, zero3: 3)" in res.stderr
    assert "zero1_no_offload" in res.stderr and "--cases 'zero3_*'" in res.stderr
    res = zbench("run", "six-case", "--set", "zero.offload=nvme", "--dry-run", "--results-dir", str(tmp_path))
    assert res.returncode == 2 and "axis 'offload' sets zero.offload" in res.stderr
    assert "no label of axis 'offload' sets zero.offload='nvme'" in res.stderr and not any(tmp_path.iterdir())
    res = zbench("show", "six-case", "--set", "zero.stage=3", "--cases", "zero3_*")
    assert res.returncode == 0, res.stderr
    assert [line.split("\t")[:3] for line in res.stdout.splitlines()[1:]] == [
        ["zero3_no_offload", "ppo", "3"], ["zero3_cpu_offload", "ppo", "3"]]
    # an explicit case's own setting is a name too
    path = write(tmp_path, "base: {algorithm: grpo}\ncases: [{name: ddp, set: {zero.stage: 0}}]\n")
    res = zbench("show", path, "--set", "zero.stage=2")
    assert res.returncode == 2 and "the matrix's case 'ddp' sets zero.stage=0" in res.stderr


def test_show_prints_whole_names_when_piped() -> None:
    """Piped, `show` prints tab-separated lines: no case name cut to fit a terminal width."""
    res = zbench("show", "twelve-case")
    assert res.returncode == 0, res.stderr
    names = [line.split("\t")[0] for line in res.stdout.splitlines()[1:]]
    assert names == [c.name for c in expand(load_matrix("twelve-case"))] and "grpo_zero3_cpu_offload" in names


def test_runner_workers_fill_in_below_a_matrix_that_sets_its_own(tmp_path: Path) -> None:
    """A runner's num_workers is the ranks of a case that names none; a case named for its ranks keeps them."""
    matrix = write(tmp_path, "base: {algorithm: ppo}\naxes:\n  ranks: {one: {trainer.world_size: 1}}"
                             "\ncases: [{name: plain, set: {zero.stage: 2}}]\n")
    runner = write(tmp_path, "num_workers: 2\n", "two.yaml")
    res = zbench("run", matrix, "--runner", runner, "--dry-run", "--steps", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["one\ttrainer.world_size=1", "plain\ttrainer.world_size=2 zero.stage=2"]


def test_a_config_holding_part_of_a_later_group_is_incomplete(tmp_path: Path) -> None:
    """The keys that changed the loss came together: a config.yaml with none of them ran the old loss, one with
    some of them is truncated or edited, and a complete read names what it lacks instead of guessing."""
    import yaml

    full = yaml.safe_load(dump_yaml(from_dict({})))
    for section, key in (("actor", "loss_agg"), ("critic", "loss_agg"), ("trainer", "sort_micro_batches")):
        del full[section][key]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(full))
    assert load_case_config(path, complete=True).critic.loss_agg == "micro-token-mean"
    full["actor"]["loss_agg"] = "token-mean"
    path.write_text(yaml.safe_dump(full))
    with pytest.raises(ConfigError, match=r"lacks critic\.loss_agg, trainer\.sort_micro_batches"):
        load_case_config(path, complete=True)


def test_a_config_from_before_the_head_took_the_loss_reads_whole(tmp_path: Path) -> None:
    """A config.yaml written before `model.head_loss_in_forward` existed is complete (its case can be resumed) and
    reads as what it ran: the loss after the head."""
    import yaml

    full = yaml.safe_load(dump_yaml(from_dict({"model": {"head_loss_in_forward": True}})))
    del full["model"]["head_loss_in_forward"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(full))
    assert load_case_config(path, complete=True).model.head_loss_in_forward is False


def test_committed_run_roots_stay_readable() -> None:
    """Every config.yaml under results/reference/ loads with today's schema (keys added since sit at their defaults,
    or at the behaviour the run had where a new default changed it; a retired key is accepted only at the value whose
    behaviour zbench still has)."""
    import yaml

    configs = sorted((Path(__file__).resolve().parents[1] / "results" / "reference").rglob("config.yaml"))
    assert configs
    loaded = {path: load_case_config(path) for path in configs}
    # runs recorded before the loss's token mean covered the whole optimizer step read as what they ran
    older = [cfg for path, cfg in loaded.items() if "loss_agg" not in path.read_text()]
    assert older and all(c.actor.loss_agg == "micro-token-mean" and not c.trainer.sort_micro_batches for c in older)
    newer = [cfg for path, cfg in loaded.items() if "loss_agg" in path.read_text()]
    assert newer and all(c.actor.loss_agg == "token-mean" for c in newer)
    # the graph loop held its KV cache through training before it could give it back
    held = [cfg for path, cfg in loaded.items() if "release_kv_cache" not in path.read_text()]
    assert held and not any(c.rollout.release_kv_cache for c in held)
    # one that names it reads as it says (runs since have given it back, and held it where asked to)
    named = {path: cfg for path, cfg in loaded.items() if "release_kv_cache" in path.read_text()}
    said = {path: yaml.safe_load(path.read_text())["rollout"]["release_kv_cache"] for path in named}
    assert any(said.values()) and all(cfg.rollout.release_kv_cache == said[path] for path, cfg in named.items())
    # a run root recorded just before (its config otherwise complete) can still be resumed
    last_held = Path(__file__).resolve().parents[1] / "results/reference/shared-prefix-20261128"
    [path] = last_held.glob("gpu-ppo_*/zero1_auto/config.yaml")
    assert not load_case_config(path, complete=True).rollout.release_kv_cache
    with pytest.raises(ConfigError, match=r"rollout.request_seeds: False is no longer supported"):
        from_dict({"rollout": {"request_seeds": False}})
    assert from_dict({"rollout": {"request_seeds": True}}) == from_dict({})


def test_gpu_hf_cases_take_the_graph_loop_where_it_has_run_fast(tmp_path: Path) -> None:
    """On CUDA an hf case that names neither decode loop takes the CUDA-graph loop where it has run inside cases with
    its Triton attention: ZeRO-1/2 (GRPO: 1-3) with the replica on the GPU (not parked off it by an offloaded optimizer), a model
    whose attention the kernels compute. A named loop or attention, vLLM and the CPU keep theirs; naming the loop's
    attention alone turns the loop on."""
    ref = [("trainer.device", "cuda"), ("trainer.world_size", 2), ("trainer.train_batch_size", 64),
           ("actor.ppo_mini_batch_size", 64), ("rollout.max_new_tokens", 512), ("data.max_prompt_length", 512),
           ("model.path", "qwen3-0.6b")]

    def loops(*sets: tuple[str, object], matrix: str = "six-case") -> dict[str, bool]:
        cases = expand(load_matrix(matrix), sets=[*ref, *sets], device_defaults=True)
        return {c.name: c.config.rollout.cuda_graph for c in cases}

    measured = {"zero1_no_offload", "zero2_no_offload"}
    assert loops() == {name: name in measured for name in loops()}
    # any number of rows; GRPO's ZeRO-3 has run the loop too, PPO's not
    assert {n for n, on in loops(matrix="grpo-six-case").items() if on} == measured | {"zero3_no_offload"}
    assert {n for n, on in loops(matrix="ddp-vs-zero").items() if on} == {"zero1_no_ac", "zero1_ac", "zero2_no_ac",
                                                                         "zero2_ac"}  # not ZeRO-0
    assert replica_parks(from_dict({"zero": {"stage": 3, "offload": "auto"}}))
    assert not replica_parks(from_dict({"zero": {"stage": 3, "offload": "none"}}))
    z1 = expand(load_matrix("six-case"), sets=ref, device_defaults=True)[0]
    assert z1.device_defaults["rollout.cuda_graph"] is True and z1.config.rollout.decode_attention == "auto"
    assert graph_loop_measured(z1.config)
    assert not any(loops(("rollout.backend", "vllm")).values())
    assert not any(loops(("rollout.static_cache", True)).values())
    assert not any(loops(("rollout.cuda_graph", False)).values())
    # SDPA records each new prompt width again: no default there, but a named attention asks for the loop
    assert not graph_loop_measured(with_overrides(z1.config, {"rollout.decode_attention": "sdpa"}))
    assert all(loops(("rollout.decode_attention", "sdpa")).values())
    # heads of 80 dimensions: the Triton kernels do not take them (a local model directory of that shape)
    from transformers import Qwen3Config

    odd = tmp_path / "qwen3-hd80"
    Qwen3Config(hidden_size=640, num_attention_heads=8, num_key_value_heads=4, head_dim=80, num_hidden_layers=2,
                intermediate_size=1024, vocab_size=1000).save_pretrained(odd)
    assert not graph_loop_measured(with_overrides(z1.config, {"model.path": str(odd)}))
    cpu = expand(load_matrix("six-case"), sets=[("trainer.device", "cpu")], device_defaults=True)[0]
    assert not cpu.config.rollout.cuda_graph and cpu.device_defaults == {}


def test_a_model_whose_cache_cannot_be_given_back_keeps_grpo_on_vllm(tmp_path: Path) -> None:
    """A model whose static cache holds sliding-window layers: the graph loop could not give that cache back, so
    `auto` leaves GRPO on vLLM, GRPO's ZeRO-3 gets no loop by default, and where the loop is asked for anyway the
    memory model holds its cache through training."""
    from transformers import Qwen3Config

    from zbench.analyze.activations import geometry_memory

    sliding = tmp_path / "qwen3-sliding"
    Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=4,
                intermediate_size=3072, vocab_size=151936, layer_types=["sliding_attention"] * 4, sliding_window=256,
                use_sliding_window=True).save_pretrained(sliding)
    ref = [("trainer.device", "cuda"), ("trainer.world_size", 2), ("trainer.train_batch_size", 64),
           ("actor.ppo_mini_batch_size", 64), ("rollout.max_new_tokens", 512), ("data.max_prompt_length", 512)]
    plain = {c.name: c.config for c in expand(load_matrix("grpo-six-case"), sets=[*ref, ("model.path", "qwen3-0.6b")])}
    odd = {c.name: c.config for c in expand(load_matrix("grpo-six-case"), sets=[*ref, ("model.path", str(sliding))])}
    assert kv_cache_released(plain["zero2_no_offload"]) and not kv_cache_released(odd["zero2_no_offload"])
    auto = {"rollout.backend": "auto", "rollout.cuda_graph": True}
    assert auto_takes_graph_loop(with_overrides(plain["zero2_no_offload"], auto))
    assert not auto_takes_graph_loop(with_overrides(odd["zero2_no_offload"], auto))
    assert graph_loop_measured(plain["zero3_no_offload"]) and not graph_loop_measured(odd["zero3_no_offload"])
    asked = geometry_memory(with_overrides(odd["zero2_no_offload"], {"rollout.cuda_graph": True}), True)
    assert asked.held_kv > 0 and asked.kv_cache == 0


def test_auto_takes_the_graph_loop_where_it_was_measured_faster() -> None:
    """`rollout.backend=auto` on a GPU takes the graph loop for PPO at up to 32 rows a rank, and for GRPO at up to 128
    where the loop gives its KV cache back between rollouts; at ZeRO-1/2, the replica on the GPU, and nothing only
    vLLM does; vLLM elsewhere. Where vLLM runs it gets its fitted KV cache and no loop setting, where the loop runs it
    gets the loop and no vLLM setting, and the memory model counts the loop's cache: released like vLLM's, or held
    through training where asked."""
    from zbench.analyze.activations import geometry_memory

    ref = [("trainer.device", "cuda"), ("trainer.world_size", 2), ("trainer.train_batch_size", 64),
           ("actor.ppo_mini_batch_size", 64), ("rollout.max_new_tokens", 512), ("data.max_prompt_length", 512),
           ("model.path", "qwen3-0.6b"), ("rollout.backend", "auto")]

    def loop(matrix: str, *sets: tuple[str, object]) -> dict[str, bool]:
        cases = expand(load_matrix(matrix), sets=[*ref, *sets], device_defaults=True)
        for c in cases:
            taken = auto_takes_graph_loop(c.config)
            assert c.config.rollout.kv_cache_fit is not taken, c.name
            assert ("rollout.cuda_graph" in c.device_defaults) is taken or "rollout.cuda_graph" in c.overrides, c.name
            assert (rollout_engine(c.config, True) == "hf-graph") is taken, c.name
            memory = geometry_memory(c.config, True)
            assert (memory.held_kv > 0) is (taken and not c.config.rollout.release_kv_cache), c.name
        return {c.name: auto_takes_graph_loop(c.config) for c in cases}

    # PPO: 32 rows a rank; ZeRO-3 and the offloaded cases were not measured with the loop
    assert loop("six-case") == {"zero1_no_offload": True, "zero2_no_offload": True, "zero3_no_offload": False,
                                "zero1_cpu_offload": False, "zero2_cpu_offload": False, "zero3_cpu_offload": False}
    grpo = {"zero1_no_offload": True, "zero2_no_offload": True, "zero3_no_offload": True,
            "zero1_cpu_offload": False, "zero2_cpu_offload": False, "zero3_cpu_offload": False}
    assert loop("grpo-six-case") == grpo  # 64 prompts x 4 over 2 ranks: 128 rows a rank, the cache given back
    assert not any(loop("grpo-six-case", ("rollout.release_kv_cache", False)).values())  # held: vLLM
    assert not any(loop("grpo-six-case", ("trainer.world_size", 1)).values())  # 256 rows on the one rank
    # PPO's ZeRO-3 has not run the loop; GRPO's has
    assert not loop("six-case", ("rollout.release_kv_cache", True))["zero3_no_offload"]
    [grpo_z3] = [c.config for c in expand(load_matrix("grpo-six-case"), sets=ref) if c.name == "zero3_no_offload"]
    assert graph_loop_measured(grpo_z3)  # ZeRO-3 ran the loop with its cache given back, not held
    assert not graph_loop_measured(with_overrides(grpo_z3, {"rollout.release_kv_cache": False}))
    assert loop("six-case", ("rollout.release_kv_cache", False)) == loop("six-case")  # PPO's 32 rows either way
    for named in (("rollout.cuda_graph", False), ("rollout.log_probs", True), ("rollout.enforce_eager", True)):
        assert not any(loop("six-case", named).values()), named
    # the loop's attention named beside auto: SDPA's loop was not measured faster, so auto would run vLLM, and the
    # named attention would choose nothing; said so, rather than recorded as if it ran
    with pytest.raises(ConfigError, match=r"set rollout\.cuda_graph=true"):
        loop("six-case", ("rollout.decode_attention", "sdpa"))
    assert not any(loop("six-case", ("trainer.world_size", 1)).values())  # 64 rows on the one rank
    ddp = loop("ddp-vs-zero")  # DDP (ZeRO-0) was not measured with the loop
    assert {n for n, taken in ddp.items() if taken} == {"zero1_no_ac", "zero1_ac", "zero2_no_ac", "zero2_ac"}
    # `zbench show` says which loop each case will sample with
    res = zbench("show", "six-case", *[a for k, v in ref for a in ("--set", f"{k}={v}")])
    assert res.returncode == 0, res.stderr
    header, *rows = (line.split("\t") for line in res.stdout.splitlines())
    at = header.index("rollout")
    assert {r[0]: r[at] for r in rows} == {"zero1_no_offload": "hf-graph", "zero2_no_offload": "hf-graph",
                                           "zero3_no_offload": "vllm", "zero1_cpu_offload": "vllm",
                                           "zero2_cpu_offload": "vllm", "zero3_cpu_offload": "vllm"}
    hf = expand(load_matrix("six-case"), sets=[*ref[:-1], ("rollout.backend", "hf")], device_defaults=True)
    assert [rollout_engine(c.config, True) for c in hf] == ["hf-graph"] * 2 + ["hf-generate"] * 4
    assert rollout_engine(hf[0].config, False) == "hf-loop"  # on a CPU the same loop runs eagerly


def test_gpu_cases_take_the_fast_geometry_for_keys_nothing_names() -> None:
    """On CUDA the keys no matrix, case or --set names take the GPU's defaults; named keys never change, and the
    CPU keeps the dataclass defaults."""
    ref = [("trainer.device", "cuda"), ("trainer.world_size", 1), ("trainer.train_batch_size", 32),
           ("actor.ppo_mini_batch_size", 32), ("rollout.max_new_tokens", 512), ("data.max_prompt_length", 512),
           ("rollout.backend", "vllm")]
    grpo = {c.name: c for c in expand(load_matrix("grpo-six-case"), sets=ref, device_defaults=True)}
    z2, z3 = grpo["zero2_no_offload"], grpo["zero3_no_offload"]
    assert z2.config.actor.micro_batch_size_per_gpu == 32 and z3.config.actor.micro_batch_size_per_gpu == 64
    assert z2.config.actor.forward_micro_batch_size_per_gpu == 64 and not z2.config.model.gradient_checkpointing
    # compiled layers checkpoint none; the tiny model's activations are small beside its KV cache: all kept
    assert z2.device_defaults["model.activation_memory_budget"] == 1.0
    assert z2.config.rollout.kv_cache_fit and "critic.micro_batch_size_per_gpu" not in z2.device_defaults
    assert z2.device_defaults["actor.micro_batch_size_per_gpu"] == 32 and not set(z2.device_defaults) & set(z2.overrides)
    assert z2.config.model.head_loss_in_forward and z2.device_defaults["model.head_loss_in_forward"] is True
    # without the fused head there is no head to take the loss: the default stands aside, and the config is valid
    plain = expand(load_matrix("grpo-six-case"), sets=[*ref, ("model.fused_head", False)], device_defaults=True)[0]
    assert not plain.config.model.head_loss_in_forward and "model.head_loss_in_forward" not in plain.device_defaults
    # a named key stays as named, the others still move; the critic (PPO) gets the same geometry
    ppo = expand(load_matrix("six-case"), sets=[*ref, ("actor.micro_batch_size_per_gpu", 8),
                                                 ("rollout.gpu_memory_utilization", 0.3)], device_defaults=True)[0]
    assert ppo.config.actor.micro_batch_size_per_gpu == 8 and ppo.config.critic.micro_batch_size_per_gpu == 32
    assert not ppo.config.rollout.kv_cache_fit and ppo.config.critic.forward_micro_batch_size_per_gpu == 32
    # PPO's critic updates behind the next rollout where that was measured faster (ZeRO-1/2 with nothing offloaded,
    # ZeRO-3 with parameters and optimizer on the CPU), in turns elsewhere and wherever a case names it; GRPO has no
    # critic to move
    modes = {c.name: c.config.trainer.critic_update for c in expand(load_matrix("six-case"), sets=ref, device_defaults=True)}
    assert modes == {"zero1_no_offload": "overlap", "zero2_no_offload": "overlap", "zero3_no_offload": "serial",
                     "zero1_cpu_offload": "serial", "zero2_cpu_offload": "serial", "zero3_cpu_offload": "overlap"}
    # by what each offload does at its stage: `auto` is the CPU at ZeRO-3, NVMe the CPU at ZeRO-1/2 (not faster);
    # NVMe at ZeRO-3 and ZeRO-0 were not measured
    assert critic_overlap_faster(3, "auto") and critic_overlap_faster(2, "none")
    assert not any(critic_overlap_faster(*where) for where in ((3, "nvme"), (2, "nvme"), (1, "auto"), (0, "none")))
    named = expand(load_matrix("six-case"), sets=[*ref, ("trainer.critic_update", "concurrent")], device_defaults=True)
    assert {c.config.trainer.critic_update for c in named} == {"concurrent"}
    assert "trainer.critic_update" not in z2.device_defaults and z2.config.trainer.critic_update == "serial"
    cpu_ppo = expand(load_matrix("six-case"), sets=[("trainer.device", "cpu")], device_defaults=True)[0]
    assert cpu_ppo.config.trainer.critic_update == "serial" and cpu_ppo.device_defaults == {}
    # micro-batches divide the rank's share of a mini-batch (here 3 prompts x 4 samples over 2 ranks: 6)
    odd = expand(load_matrix("grpo-six-case"), sets=[("trainer.device", "cuda"), ("trainer.train_batch_size", 3),
                                                     ("actor.ppo_mini_batch_size", 3), ("trainer.world_size", 2)],
                 device_defaults=True)[0]
    assert odd.config.actor.micro_batch_size_per_gpu == 6 and odd.config.actor.forward_micro_batch_size_per_gpu == 6
    # ddp-vs-zero names checkpointing on its axis: that stays
    assert not expand(load_matrix("ddp-vs-zero"), sets=[("trainer.device", "cuda")],
                      device_defaults=True)[0].config.model.gradient_checkpointing
    cpu = expand(load_matrix("grpo-six-case"), sets=[("trainer.device", "cpu")], device_defaults=True)[0]
    assert cpu.device_defaults == {} and cpu.config.actor.micro_batch_size_per_gpu == 4
    # `zbench estimate --device cuda` on this machine sizes what a GPU run would take, --device cpu the CPU's
    from zbench.analyze.memory import target_cases

    sized = {cuda: target_cases("grpo-six-case", cuda, tuple(ref[2:]), ("zero3_no_offload",))[0][1] for cuda in (True, False)}
    assert sized[True].actor.micro_batch_size_per_gpu == 64 and not sized[True].model.gradient_checkpointing
    assert sized[True].model.activation_memory_budget < 1.0 and sized[False].model.activation_memory_budget == 1.0
    assert sized[False].actor.micro_batch_size_per_gpu == 4 and not sized[False].model.gradient_checkpointing
