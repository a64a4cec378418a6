"""Runner profiles (runners/*.yaml): how a case process is started and how it reaches Ray.

A profile's fields become the case process's environment: ``ZBENCH_RAY_ADDRESS`` (empty = the case starts a
private Ray on 127.0.0.1; ``auto``, ``host:port`` or ``ray://host:port`` = join that cluster) and
the profile's ``env`` verbatim; ``num_workers`` becomes the cases' ``trainer.world_size``.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from zbench import shipped_specs
from zbench.env import REACH_CLUSTER, REACH_PRIVATE_RAY, recorded_variables

_ADDRESS_RE = re.compile(r"auto|ray://[\w.\-]+:\d+|[\w.\-]+:\d+")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class RunnerProfile:
    """One runner profile, validated on load."""

    name: str  # the file's stem
    description: str = ""  # one line for `zbench runners` style listings
    ray_address: str = ""  # ZBENCH_RAY_ADDRESS: "" = local Ray per case; auto, host:port, ray://host:port
    node_ip_address: str = ""  # ZBENCH_RAY_NODE_IP: this node's address in the cluster ("" = Ray's own guess)
    num_workers: int | None = None  # ranks per case (trainer.world_size) unless the case or --set names one; None: the matrix's
    python: str | None = None  # interpreter for the engine; None = the one running zbench
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment variables, verbatim

    def __post_init__(self) -> None:
        where = f"runner profile {self.name!r}"
        if self.ray_address and not _ADDRESS_RE.fullmatch(self.ray_address):
            raise ValueError(
                f"{where}: ray_address {self.ray_address!r} is not valid; use '' (start a local Ray), 'auto', "
                "'host:port' or 'ray://host:port'"
            )
        if self.num_workers is not None and (isinstance(self.num_workers, bool) or self.num_workers < 1):
            raise ValueError(
                f"{where}: num_workers must be a positive integer or null, got {self.num_workers!r}"
            )
        for key in self.env:
            if not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f"{where}: env key {key!r} is not a valid environment variable name")

    def case_env(self) -> dict[str, str]:
        """Environment variables for the case process (on top of the inherited environment)."""
        return {
            **{k: str(v) for k, v in self.env.items()},
            "ZBENCH_RAY_ADDRESS": self.ray_address,
            "ZBENCH_RAY_NODE_IP": self.node_ip_address,
        }

    def recorded_environment(self) -> dict[str, Any]:
        """The manifest's record of the environment the cases start with (this process's, with the profile's `env`
        on top; `zbench.env.recorded_variables`) and of which processes it reaches: on a Ray cluster, the
        workers take their nodes' environment, not the case's."""
        return {"variables": recorded_variables({**os.environ, **self.case_env()}),
                "variables_reach": REACH_CLUSTER if self.ray_address else REACH_PRIVATE_RAY}

    def command(self) -> tuple[str, ...]:
        """The argv prefix that starts the engine; the case dir is appended per case."""
        return (self.python or sys.executable, "-m", "zbench.engine")


def runners_dirs() -> list[Path]:
    """Where profiles are looked up: the installed package data, then the source checkout's runners/."""
    shipped = shipped_specs("runners")
    return [shipped] if shipped.is_dir() else []


def available_runners() -> list[str]:
    """Names of the bundled runner profiles."""
    return sorted({p.stem for d in runners_dirs() for p in d.glob("*.yaml")})


def _closest(word: str, options: list[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def load_runner_profile(name_or_path: str) -> RunnerProfile:
    """Load a profile by name (``local``, ``ray``) or from a YAML file path; errors name the file and key."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        names = available_runners()
        found = [d / f"{name_or_path}.yaml" for d in runners_dirs() if (d / f"{name_or_path}.yaml").is_file()]
        if not found:
            raise ValueError(
                f"unknown runner profile {name_or_path!r}{_closest(name_or_path, names)}; "
                f"available: {', '.join(names) or 'none'}, or a path to a .yaml file"
            )
        path = found[0]
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a runner profile must be a mapping of keys, got {type(data).__name__}")
    valid = [f.name for f in fields(RunnerProfile) if f.name != "name"]
    for key in data:
        if key not in valid:
            raise ValueError(
                f"{path}: unknown key {key!r}{_closest(str(key), valid)}; valid keys: {', '.join(valid)}"
            )
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise ValueError(f"{path}: env must be a mapping of NAME: value, got {env!r}")
    for key in ("description", "ray_address", "node_ip_address", "python"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {data[key]!r}")
    try:
        return RunnerProfile(
            name=path.stem,
            description=data.get("description") or "",
            ray_address=data.get("ray_address") or "",
            node_ip_address=data.get("node_ip_address") or "",
            num_workers=data.get("num_workers"),
            python=data.get("python"),
            env={str(k): "" if v is None else str(v) for k, v in env.items()},
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
