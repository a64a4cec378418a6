"""Matrices: named sets of cases, as data. Load `matrices/*.yaml`, expand axes into cases, apply `--set` overrides.

A matrix file:

    description: PPO, ZeRO 1/2/3 x offload none/cpu
    base: {algorithm: ppo}                      # partial RunConfig shared by every case
    axes:                                       # cartesian product, first axis outermost
      offload: {no_offload: {zero.offload: none}, cpu_offload: {zero.offload: cpu}}
      stage: {zero1: {zero.stage: 1}, zero2: {zero.stage: 2}, zero3: {zero.stage: 3}}
    name: "{stage}_{offload}"                   # case-name template over axis labels
    exclude: [{stage: zero1, offload: cpu_offload}, "zero3_*"]   # label combinations or name globs
    cases: [{name: ddp, set: {zero.stage: 0}}]  # explicit cases after the product
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import itertools
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zbench import shipped_specs
from zbench.config import (
    GRAPH_LOOP_KEYS,
    ConfigError,
    RunConfig,
    cuda_defaults,
    from_dict,
    has_dotted,
    read_yaml,
    set_dotted,
)

MATRIX_KEYS = ("description", "base", "axes", "name", "exclude", "cases")


@dataclass(frozen=True, slots=True)
class Case:
    """One case of a matrix: its name, its resolved config, the overrides that made it, and the device's defaults
    it took for keys nothing named (`zbench.config.cuda_defaults`; empty on the CPU)."""

    name: str
    config: RunConfig
    overrides: dict[str, Any] = field(default_factory=dict)
    device_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Matrix:
    """A parsed matrix file."""

    name: str
    source: str
    description: str
    base: dict[str, Any]
    axes: list[tuple[str, list[tuple[str, dict[str, Any]]]]]
    name_template: str
    exclude: list[Any]
    cases: list[tuple[str, dict[str, Any]]]


def check_name(value: str, what: str, source: str | None = None) -> str:
    """A case name or tag must be one directory name inside the results directory (the store's rule)."""
    from zbench.runroot.casedir import validate_name

    try:
        return validate_name(value, what)
    except ValueError as err:
        raise ConfigError("", str(err), source) from None


def matrix_dir() -> Path:
    """Where the shipped matrices live (package data, or the source checkout's `matrices/`)."""
    return shipped_specs("matrices")


def shipped_matrices() -> dict[str, Path]:
    """Shipped matrix names and their files."""
    return {p.stem: p for p in sorted(matrix_dir().glob("*.yaml"))}


def find_matrix(name_or_path: str) -> Path:
    """A shipped matrix name or a path to a YAML file; an unknown name suggests the closest shipped one."""
    shipped = shipped_matrices()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError("", f"matrix file not found: {path}")
        return path
    close = difflib.get_close_matches(name_or_path, list(shipped), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError("", f"unknown matrix {name_or_path!r}: {hint}shipped matrices are {', '.join(shipped)}, "
                          "or give a path to a YAML file")


def _overrides(raw: Any, where: str, source: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"expected a mapping of dotted keys to values, got {raw!r}", source)
    return {str(k): v for k, v in raw.items()}


def load_matrix(name_or_path: str) -> Matrix:
    """Read and check a matrix file (structure only; case configs are validated on expansion)."""
    path = find_matrix(name_or_path)
    source = str(path)
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError("", "a matrix file is a mapping with keys " + ", ".join(MATRIX_KEYS), source)
    for key in data:
        if key not in MATRIX_KEYS:
            close = difflib.get_close_matches(str(key), MATRIX_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(str(key), f"unknown matrix key{hint} (valid: {', '.join(MATRIX_KEYS)})", source)
    base = data.get("base") or {}
    if not isinstance(base, Mapping):
        raise ConfigError("base", f"expected a mapping (a partial case config), got {base!r}", source)
    axes: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    raw_axes = data.get("axes") or {}
    if not isinstance(raw_axes, Mapping):
        raise ConfigError("axes", "expected a mapping of axis name -> {label: {dotted.key: value}}", source)
    for axis, values in raw_axes.items():
        if not isinstance(values, Mapping) or not values:
            raise ConfigError(f"axes.{axis}", "expected a non-empty mapping of label -> overrides", source)
        axes.append((str(axis), [(str(lbl), _overrides(ov, f"axes.{axis}.{lbl}", source)) for lbl, ov in values.items()]))
    template = data.get("name") or "_".join("{" + a + "}" for a, _ in axes)
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
    missing = fields - {a for a, _ in axes}
    if missing:
        raise ConfigError("name", f"template {template!r} uses {sorted(missing)}, not axes of this matrix "
                                  f"(axes: {', '.join(a for a, _ in axes) or 'none'})", source)
    cases: list[tuple[str, dict[str, Any]]] = []
    for i, case in enumerate(data.get("cases") or []):
        if not isinstance(case, Mapping) or "name" not in case or set(case) - {"name", "set"}:
            raise ConfigError(f"cases[{i}]", "expected {name: ..., set: {dotted.key: value}}", source)
        cases.append((str(case["name"]), _overrides(case.get("set"), f"cases[{i}].set", source)))
    exclude = list(data.get("exclude") or [])
    if not axes and not cases:
        raise ConfigError("", "a matrix needs axes or cases", source)
    return Matrix(path.stem, source, str(data.get("description") or ""), copy.deepcopy(dict(base)), axes,
                  template, exclude, cases)


def _excluded(name: str, labels: dict[str, str], exclude: Iterable[Any]) -> bool:
    for rule in exclude:
        if isinstance(rule, str) and fnmatch.fnmatchcase(name, rule):
            return True
        if isinstance(rule, Mapping) and rule and all(labels.get(str(k)) == str(v) for k, v in rule.items()):
            return True
    return False


def _check_sets_keep_names(matrix: Matrix, planned: list[tuple[str, dict[str, Any], dict[str, str]]],
                           sets: list[tuple[str, Any]]) -> None:
    """Refuse a `--set` that changes a key a case's name stands for (an axis value or an explicit case's own
    setting): every case would then run the `--set` value under a name that says otherwise, and results are read
    back by name. A `--set` equal to every chosen case's own value changes nothing and passes."""
    for key, value in sets:
        clash = [(name, overrides[key], owners[key]) for name, overrides, owners in planned
                 if key in overrides and overrides[key] != value]
        if not clash:
            continue
        owner = clash[0][2]
        axis_name, axis = next(((a, values) for a, values in matrix.axes if owner == f"axis {a!r}"), ("", None))
        if axis is not None:
            matching = [lbl for lbl, ov in axis if ov.get(key) == value]
            glob = matrix.name_template.format(**{a: matching[0] if a == axis_name else "*" for a, _ in matrix.axes}
                                               ) if matching else ""
            pick = (f"choose the cases that already run it with --cases '{glob}' instead" if matching else
                    f"no label of {owner} sets {key}={value!r}: add one to the matrix, or write a matrix without "
                    f"that axis")
            labels = ", ".join(f"{lbl}: {ov.get(key)!r}" for lbl, ov in axis)
            what = f"the matrix's {owner} sets {key} ({labels})"
        else:
            pick = "leave that case out with --cases, or write a matrix that names the case for its value"
            what = f"the matrix's {owner} sets {key}={clash[0][1]!r}"
        names = ", ".join(n for n, _, _ in clash[:4]) + (" ..." if len(clash) > 4 else "")
        raise ConfigError("", f"--set {key}={value!r}: {what}, so {names} would run {key}={value!r} under a "
                              f"name that says otherwise; {pick}", matrix.source)


def _device_defaults(data: dict[str, Any], where: str, on_cuda: bool | None) -> dict[str, Any]:
    """`cuda_defaults` for a case's nested config `data` when it will run on CUDA (as `on_cuda` says, or where
    None, as its `trainer.device` resolves here), else nothing. The case is first read with micro-batch 1 wherever
    nothing names one: the CPU's default size need not divide a GPU batch; and without MPS's SM share, which needs
    the critic's update beside other work, as the defaults may make it (`trainer.critic_update` overlap); and with
    the graph loop on where its attention or its steps a graph are named, as the defaults make it
    (`rollout.cuda_graph`)."""
    probe = copy.deepcopy(data)
    for key in ("actor.micro_batch_size_per_gpu", "critic.micro_batch_size_per_gpu"):
        if not has_dotted(probe, key):
            set_dotted(probe, key, 1)
    if has_dotted(probe, "trainer.critic_sm_percent"):
        set_dotted(probe, "trainer.critic_sm_percent", 0)
    rollout = probe.get("rollout") if isinstance(probe.get("rollout"), dict) else {}
    if (any(key in rollout for key in GRAPH_LOOP_KEYS) and "cuda_graph" not in rollout
            and rollout.get("backend") != "vllm" and not rollout.get("static_cache")):
        set_dotted(probe, "rollout.cuda_graph", True)  # the loop's own key named: the GPU defaults turn the loop on
    cfg = from_dict(probe, where)
    cuda = cfg.trainer.uses_cuda() if on_cuda is None else on_cuda
    return cuda_defaults(cfg, lambda key: has_dotted(data, key)) if cuda else {}


def expand(
    matrix: Matrix,
    seed: int | None = None,
    steps: int | None = None,
    sets: Iterable[tuple[str, Any]] = (),
    case_globs: Iterable[str] = (),
    run_defaults: Mapping[str, Any] | None = None,
    device_defaults: bool = False,
    on_cuda: bool | None = None,
) -> list[Case]:
    """The matrix's cases in order, each validated; `sets` apply to every case after the matrix's own values,
    `run_defaults` (the runner's worker count) before them. With `device_defaults`, a case that will run on CUDA
    takes the GPU's defaults for the keys none of those name (`cuda_defaults`); `on_cuda` says where it will run
    when that is not this machine (`zbench estimate --device cuda`)."""
    sets = list(sets)
    # Precedence, lowest first: base, the run's --seed/--steps and runner defaults, the case's own axis values,
    # then --set.
    run_level: dict[str, Any] = dict(run_defaults or {})
    if seed is not None:
        run_level["seed"] = seed
    if steps is not None:
        run_level["steps"] = steps
    planned: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # name, overrides, who set each key
    for combo in itertools.product(*(values for _, values in matrix.axes)) if matrix.axes else []:
        labels = {axis: label for (axis, _), (label, _) in zip(matrix.axes, combo, strict=True)}
        name = matrix.name_template.format(**labels)
        if _excluded(name, labels, matrix.exclude):
            continue
        overrides: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for (axis, _), (_, ov) in zip(matrix.axes, combo, strict=True):
            overrides.update(ov)
            owners.update(dict.fromkeys(ov, f"axis {axis!r}"))
        planned.append((name, overrides, owners))
    planned.extend((n, o, dict.fromkeys(o, f"case {n!r}")) for n, o in matrix.cases)
    globs = [g for g in case_globs if g]
    if globs:
        chosen = [p for p in planned if any(fnmatch.fnmatchcase(p[0], g) for g in globs)]
        if not chosen:
            raise ConfigError("", f"--cases {','.join(globs)} matches none of {', '.join(p[0] for p in planned)}")
        planned = chosen
    _check_sets_keep_names(matrix, planned, sets)
    seen: set[str] = set()
    cases = []
    for name, overrides, _ in planned:
        check_name(name, "case name", matrix.source)
        if name in seen:
            raise ConfigError("", f"two cases are named {name!r}", matrix.source)
        seen.add(name)
        data = copy.deepcopy(matrix.base)
        for key, value in {**run_level, **overrides, "name": name}.items():
            set_dotted(data, key, value, matrix.source)
        for key, value in sets:
            set_dotted(data, key, value, "--set")
        where = f"{matrix.source} (case {name})"
        on_device = _device_defaults(data, where, on_cuda) if device_defaults else {}
        for key, value in on_device.items():
            set_dotted(data, key, value)
        cfg = from_dict(data, where)
        defaults = {k: v for k, v in (run_defaults or {}).items() if k not in overrides}
        cases.append(Case(name, cfg, {**defaults, **overrides, **dict(sets)}, on_device))
    return cases
