"""py-cpuinfo's description of this host's CPU, probed once per boot and read from disk after that.

DeepSpeed's op builders ask ``cpuinfo.get_cpu_info()`` for the CPU's architecture and SIMD flags whenever a process
loads an op (FusedAdam, CPUAdam, the CPU accelerator's shared-memory comm), and each call starts a Python child that
probes the CPU. On a 2-core machine that is about 1.1 s a call, twice in a ZeRO-2 worker's ``deepspeed.initialize``
(2.2 of its 3.4 s), in every worker of every case. The description cannot change while the host is up, so the first
probe is kept in ``<zbench cache>/cpuinfo/<key>.json`` and every later call, in any process, reads it. The key hashes
the boot id with the interpreter's machine type and the CPU model and flags the kernel reports, so a cache shared
between hosts or containers (an emulated architecture on the same kernel, VMs restored from one snapshot) never hands
one of them another's CPU. Where there is no boot id (not Linux) each process probes once. The cache only saves time:
any failure to read or write it falls back to the probe.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PROC_CPUINFO = Path("/proc/cpuinfo")


def cache_file() -> Path | None:
    """Where this boot's description is kept, or None where the host has no boot id."""
    from zbench.models import cache_root

    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    if not boot:
        return None
    try:  # the model and flags lines, once each: what tells one CPU from another under the same kernel
        cpu = sorted({line for line in PROC_CPUINFO.read_text(errors="replace").splitlines()
                      if line.startswith(("model name", "flags", "Features", "CPU implementer", "CPU part"))})
    except OSError:
        cpu = []
    key = hashlib.sha256("\n".join([boot, platform.machine(), *cpu]).encode()).hexdigest()[:20]
    return cache_root() / "cpuinfo" / f"{key}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info else None


def _write(path: Path, info: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpuinfo-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)  # whole or absent: a reader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cached(probe: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`probe` run at most once per boot: its result read from `cache_file()` when there, written there when not.
    Each caller gets its own copy; an empty result is not kept (the next call probes again)."""
    kept: dict[str, Any] = {}

    def get_cpu_info() -> dict[str, Any]:
        if kept:
            return copy.deepcopy(kept)
        try:
            path = cache_file()
        except Exception:  # no home directory to put a cache in, say: probe
            path = None
        info = _read(path) if path is not None else None
        if info is None:
            info = probe()
            if path is not None and info:
                with contextlib.suppress(Exception):  # a cache that can't be written costs the next process a probe
                    _write(path, info)
        kept.update(info or {})
        return copy.deepcopy(info)

    get_cpu_info.zbench_cached = True  # type: ignore[attr-defined]
    return get_cpu_info


def install() -> None:
    """Make ``cpuinfo.get_cpu_info`` in this process the per-boot cached one (DeepSpeed imports it at each call)."""
    import cpuinfo

    if not getattr(cpuinfo.get_cpu_info, "zbench_cached", False):
        cpuinfo.get_cpu_info = cached(cpuinfo.get_cpu_info)
