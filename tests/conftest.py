"""Test order: the files that start the most engine cases run first.

`make test` hands whole files to its test processes (pytest-xdist, `--dist loadfile --no-loadscope-reorder`),
in the order collected here. A file that takes minutes and starts last runs on alone while the other processes
sit idle, so the costliest files start first and the many short ones fill in around them.
"""

from __future__ import annotations

import pytest

# costliest first: seconds one test process spent in the file, three processes on two cores (`--durations`)
COSTLIEST_FIRST = (
    "test_engine_matrix.py",  # 470: a six-case run interrupted, resumed, merged with a rerun
    "test_tune_cli.py",  # 460
    "test_engine_case.py",  # 430
    "test_sessions.py",  # 330
    "test_fault_matrix.py",  # 320
    "test_bench_floor.py",  # 250
    "test_packaged_model.py",  # 240
    "test_trackers.py",  # 140
    "test_harness_killed.py",  # 140
    "test_full_disk.py",  # 100
    "test_two_nodes.py",  # 90
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
