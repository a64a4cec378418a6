"""The Python heap of a worker process: how long the cyclic garbage collector paused it, and freezing what lives
for the whole case.

A worker holds millions of long-lived Python objects (a DeepSpeed engine's parameter wrappers and hooks,
torch.compile's graphs and guards, vLLM's engine). Each full collection walks all of them, and a colocated
vLLM rollout, whose scheduler is Python and allocates per token, triggers collections throughout generation:
the rollout then waits on the host while the GPU idles. `freeze_survivors` moves every object alive after the
first step into the collector's permanent generation, where it is no longer walked; garbage made later is
collected as before. `GcClock` measures the pauses, reported per step as `perf/gc_pause_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from typing import Any


class GcClock:
    """Adds up the cyclic collector's pause time in this process from its start/stop callbacks."""

    def __init__(self) -> None:
        self.paused_s = 0.0
        self.collections = 0
        self._started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, event: str, info: dict[str, Any]) -> None:
        if event == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.paused_s += time.perf_counter() - self._started
            self.collections += 1
            self._started = None

    def take(self) -> float:
        """Seconds paused since the last call (then reset)."""
        paused, self.paused_s, self.collections = self.paused_s, 0.0, 0
        return paused

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def freeze_survivors() -> int:
    """Collect once, then move every object still alive out of the collector's reach (`gc.freeze`); returns how
    many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_dropped() -> None:
    """Free what a worker just dropped (its engines, before building the next ones): thaw the frozen heap, so the
    collector can reach the dropped objects' reference cycles; collect; give the freed heap back to the system
    (glibc's `malloc_trim`, where there is one), so the process's resident size again says what it holds."""
    gc.unfreeze()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
