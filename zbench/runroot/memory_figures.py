"""Which memory figure leads, wherever memory is shown (report, live progress, curves): the one that decides
whether a case fits. On a GPU that is the memory in use on the whole device, as nvidia-smi shows it (torch's
pool, vLLM's KV cache, CUDA contexts, every process); on CPU it is the resident memory of the case's processes.
torch's reserved and allocated counters miss what torch does not manage (vLLM's cache above all), so they never
lead while the device-wide figure exists; where they appear they are named as what they are. Runs recorded
before the device-wide figure existed lead with torch's reserved peak, under that name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryFigure:
    """One recorded memory figure: its per-step metric, its summary.tsv column and the names it is shown under."""

    metric: str
    column: str
    label: str  # in a table heading or a plot title
    short: str  # in a progress line

    @property
    def heading(self) -> str:
        """`label` with its unit, for a table column."""
        return f"{self.label} (GB)"


DEVICE = MemoryFigure("perf/device_memory_used_gb", "device_memory_used_gb", "GPU memory in use, whole device",
                      "GPU in use")
# the same device-wide figure at the end of generation and of training: which phase sets the peak (a training that
# grows into memory a sleeping rollout engine gave back leaves the peak where generation put it)
GEN = MemoryFigure("perf/device_memory_gen_gb", "device_memory_gen_gb",
                   "GPU memory in use at the end of generation, whole device", "GPU in use, generation")
TRAIN = MemoryFigure("perf/device_memory_train_gb", "device_memory_train_gb",
                     "GPU memory in use at the end of training, whole device", "GPU in use, training")
RESERVED = MemoryFigure("perf/max_memory_reserved_gb", "max_memory_reserved_gb", "GPU memory reserved by torch",
                        "torch reserved")
ALLOCATED = MemoryFigure("perf/max_memory_allocated_gb", "max_memory_allocated_gb", "GPU memory allocated by torch",
                         "torch allocated")
HOST = MemoryFigure("perf/cpu_memory_used_gb", "cpu_memory_used_gb", "CPU memory used (RSS)", "CPU RSS")

# In order of precedence: the first one a run recorded leads. A GPU run always records RESERVED, a CPU run never.
LEADING_ORDER: tuple[MemoryFigure, ...] = (DEVICE, RESERVED, HOST)


def leading(recorded: Callable[[MemoryFigure], bool]) -> MemoryFigure:
    """The figure that leads for a run, given which figures it `recorded` (asked per figure)."""
    return next((f for f in LEADING_ORDER if recorded(f)), HOST)


def leading_in_record(record: dict) -> MemoryFigure | None:
    """The figure that leads in one metrics record, or None when it holds no memory figure."""
    return next((f for f in LEADING_ORDER if isinstance(record.get(f.metric), (int, float))), None)
