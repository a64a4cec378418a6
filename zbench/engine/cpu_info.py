"""py-cpuinfo's description of this host's CPU, probed once per boot and read from disk after that.

DeepSpeed's op builders ask ``cpuinfo.get_cpu_info()`` for the CPU's architecture and SIMD flags whenever a process
loads an op (FusedAdam, CPUAdam, the CPU accelerator's shared-memory comm), and each call starts a Python child that
probes the CPU. On a 2-core machine that is about 1.1 s a call, twice in a ZeRO-2 worker's ``deepspeed.initialize``
(2.2 of its 3.4 s), in every worker of every case. The description cannot change while the host is up, so the first
probe of a boot is kept in ``<zbench cache>/cpuinfo/<boot id>.json`` and every later call, in any process, reads it.
A host without a boot id (not Linux) probes once per process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def cache_file() -> Path | None:
    """Where this boot's description is kept, or None where the host has no boot id."""
    from zbench.models import cache_root

    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return cache_root() / "cpuinfo" / f"{boot}.json" if boot else None


def cached(probe: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`probe` run at most once per boot: its result is read from `cache_file()` when there, written there when not."""

    @functools.cache
    def get_cpu_info() -> dict[str, Any]:
        path = cache_file()
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                info = json.loads(path.read_text())
                if isinstance(info, dict) and info:
                    return info
        info = probe()
        if path is not None and info:
            with contextlib.suppress(OSError):  # a cache that can't be written only costs the next process a probe
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpuinfo-")
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(info, f)
                    os.replace(tmp, path)  # whole or absent: a reader never sees half a file
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
        return info

    get_cpu_info.zbench_cached = True  # type: ignore[attr-defined]
    return get_cpu_info


def install() -> None:
    """Make ``cpuinfo.get_cpu_info`` in this process the per-boot cached one (DeepSpeed imports it at each call)."""
    import cpuinfo

    if not getattr(cpuinfo.get_cpu_info, "zbench_cached", False):
        cpuinfo.get_cpu_info = cached(cpuinfo.get_cpu_info)
