"""`zbench env` and the manifest's environment: Python and package versions, GPUs, host, git commit, DeepSpeed ops,
a Ray cluster's resources — everything a bug report or a reproduction needs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import zbench

VERSIONED_PACKAGES = ("torch", "deepspeed", "ray", "transformers", "vllm", "triton")

# environment variables that change what a case runs or how fast, recorded with the run: vLLM, NCCL, Ray, CUDA,
# torch, Triton and DeepSpeed settings, thread counts, offline switches (`VLLM_USE_V2_MODEL_RUNNER=0` picks another
# model runner; `RAY_worker_niceness` the workers' priority; `TRITON_INTERPRET=1` runs Triton kernels interpreted)
RECORDED_VARIABLE_PREFIXES = ("VLLM_", "NCCL_", "RAY_", "CUDA_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "TRITON_",
                              "DS_", "OMP_", "MKL_", "TOKENIZERS_", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# set by zbench itself for the processes that use them, whatever the harness had: the trainer's worker environment
# (zbench.engine.trainer: threads, tokenizers, the CPU accelerator) and the in-process vLLM engine
# (zbench.engine.vllm_rollout); recording the harness's value would name one the workers never ran with
SET_BY_ZBENCH = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "VLLM_ENABLE_V1_MULTIPROCESSING")
# a name with one of these words (between underscores) holds a credential
_SECRET_WORDS = frozenset({"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL",
                           "CREDENTIALS"})
HIDDEN_VALUE = "(a path or an address, not recorded)"
UNSET = "(unset)"
# which processes a run's recorded variables reach (the manifest's `variables_reach`)
REACH_PRIVATE_RAY = "the cases' processes and their private Ray's workers"
REACH_CLUSTER = "the cases' drivers only: the Ray cluster's workers have their nodes' environment"


def package_version(package: str) -> str | None:
    """A package's installed version, or None (without importing it)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_info() -> dict[str, Any]:
    """Commit and dirty flag: as stated by ``ZBENCH_GIT_COMMIT`` (a copy shipped to another machine, whose .git
    may be missing or stale, says where it came from), else of the zbench source checkout, else of the cwd."""
    if os.environ.get("ZBENCH_GIT_COMMIT"):
        return {"commit": os.environ["ZBENCH_GIT_COMMIT"], "dirty": os.environ.get("ZBENCH_GIT_DIRTY") == "1",
                "source": "ZBENCH_GIT_COMMIT"}
    source = Path(zbench.__file__).resolve().parent.parent
    for where in (source, Path.cwd()):
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
            )
            if commit.returncode != 0:
                continue
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where, capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
        except (OSError, subprocess.TimeoutExpired):
            continue
    return {"commit": None, "dirty": None}


def _gpus(probe_torch: bool) -> list[dict[str, Any]]:
    """GPU names and memory; torch.cuda when torch is already loaded (or ``probe_torch``), else nvidia-smi."""
    if "torch" in sys.modules or probe_torch:
        try:
            import torch

            if torch.cuda.is_available():
                return [
                    {
                        "name": torch.cuda.get_device_name(i),
                        "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 2),
                    }
                    for i in range(torch.cuda.device_count())
                ]
            if probe_torch:
                return []
        except ImportError:
            pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, _, mib = line.rpartition(",")
        with contextlib.suppress(ValueError):
            gpus.append({"name": name.strip(), "memory_gb": round(float(mib) / 1024, 2)})
    return gpus


def _cpu() -> dict[str, Any]:
    """The host's CPU: model name (from /proc/cpuinfo, None where there is none), logical cores, and the cores this
    process may run on. A host-bound phase (vLLM's decode loop at a few dozen rows) moves with the CPU, so results
    from two hosts of the same GPU are told apart by it."""
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                model = value.strip() or None
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "logical_cores": os.cpu_count(), "usable_cores": usable}


def recorded_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables of `RECORDED_VARIABLE_PREFIXES` set in `environ` (default: this process's), by
    name, but for those zbench sets itself (`SET_BY_ZBENCH`). A name holding a credential is left out; a value
    that is a path or an address with a user (`/`, `~`, `@`) is replaced by `HIDDEN_VALUE`, as a run's record must
    carry neither this machine's paths nor a login (the name still says the variable was set)."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(env):
        if (not name.startswith(RECORDED_VARIABLE_PREFIXES) or name in SET_BY_ZBENCH
                or _SECRET_WORDS & set(name.upper().split("_"))):
            continue
        value = env[name]
        out[name] = HIDDEN_VALUE if "/" in value or "@" in value or value.startswith("~") else value
    return out


def changed_variables(old: Mapping[str, str], new: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(name, old value, new value) of each recorded variable two environments set differently, by name; a
    variable one of them lacks is `UNSET` there."""
    return [(k, old.get(k, UNSET), new.get(k, UNSET)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def collect_environment(probe_torch: bool = False) -> dict[str, Any]:
    """Python and package versions, GPUs, CPU, host, git commit + dirty flag, the recorded environment variables:
    what a manifest or bug report needs.

    Versions come from package metadata, so nothing heavy is imported; pass ``probe_torch`` to ask torch.cuda
    for GPUs even where nvidia-smi is absent (imports torch).
    """
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    versions.update({p: package_version(p) for p in VERSIONED_PACKAGES})
    return {
        "versions": versions,
        "gpus": _gpus(probe_torch),
        "cpu": _cpu(),
        "host": socket.gethostname(),
        "platform": sys.platform,
        "git": _git_info(),
        "variables": recorded_variables(),
    }


def deepspeed_op_compatibility() -> dict[str, bool]:
    """Whether each DeepSpeed op builder (cpu_adam, fused_adam, ...) can be built here (imports deepspeed)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except ImportError:
        return {}
    compat: dict[str, bool] = {}
    for name, builder in sorted(ALL_OPS.items()):
        if name == "deepspeed_not_implemented" or builder is None:
            continue
        try:
            compat[name] = bool(builder.is_compatible(verbose=False))
        except Exception:  # a builder probing a missing toolchain may raise anything
            compat[name] = False
    return compat


def ray_cluster_status(address: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Connect to the Ray cluster at ``address`` in a subprocess and report its nodes and resources."""
    probe = (
        "import json, ray\n"
        "ray.init(address=ADDRESS, logging_level='ERROR', log_to_driver=False)\n"
        "nodes = [n for n in ray.nodes() if n.get('Alive')]\n"
        "print(json.dumps({'address': ADDRESS, 'alive_nodes': len(nodes),\n"
        "    'resources': ray.cluster_resources(), 'available': ray.available_resources()}))\n"
    ).replace("ADDRESS", json.dumps(address))
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"address": address, "error": f"no answer within {timeout_s:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        err = (out.stderr.strip().splitlines() or ["unknown error"])[-1]
        return {"address": address, "error": err}
    return json.loads(lines[-1])


def environment_report(ray_address: str | None = None) -> dict[str, Any]:
    """Everything ``zbench env`` prints: collect_environment (GPUs via torch), DeepSpeed ops, the packaged real
    checkpoints and whether their packages are installed, Ray cluster."""
    from zbench.models import PACKAGED, describe_model

    report = collect_environment(probe_torch=True)
    # DeepSpeed's logger writes to the stdout of its import ("Setting accelerator to CPU ..."): send it to stderr,
    # so that stdout holds only the report (`zbench env --json | jq`)
    with contextlib.redirect_stdout(sys.stderr):
        report["deepspeed_ops"] = deepspeed_op_compatibility()
    report["packaged_models"] = {name: describe_model(name) for name in PACKAGED}
    if ray_address:
        report["ray"] = ray_cluster_status(ray_address)
    return report
