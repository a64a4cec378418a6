"""Suite-wide collection order: the longest test files first.

`make test` hands whole files to its worker processes (`--dist loadfile --no-loadscope-reorder`) in collection order,
each worker taking the next file when it is free. Started last, a few-minute file would leave one worker running it
alone at the end; started first, the short files fill in around it. The list is the files' measured durations on two
cores, longest first; a file not named keeps its place after them, and a renamed one only loses its head start.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "test_tune_cli.py", "test_engine_case.py", "test_engine_matrix.py", "test_fault_matrix.py", "test_sessions.py",
    "test_packaged_model.py", "test_bench_floor.py", "test_harness_killed.py", "test_trackers.py", "test_full_disk.py",
    "test_two_nodes.py", "test_launch.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
