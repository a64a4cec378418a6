"""Test order: the files that start the most engine cases run first.

`make test` hands whole files to its test processes (pytest-xdist, `--dist loadfile --no-loadscope-reorder`),
in the order collected here. A file that takes minutes and starts last runs on alone while the other processes
sit idle, so the costliest files start first and the many short ones fill in around them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# costliest first: seconds one test process spent in the file, three processes on two cores (`--durations`)
COSTLIEST_FIRST = (
    "test_engine_case.py",  # 330
    "test_tune_cli.py",  # 320
    "test_engine_matrix.py",  # 250-310: a six-case run interrupted, resumed, merged with a rerun
    "test_sessions.py",  # 220
    "test_fault_matrix.py",  # 210
    "test_packaged_model.py",  # 160
    "test_trackers.py",  # 150
    "test_harness_killed.py",  # 130
    "test_bench_floor.py",  # 120
    "test_triton_kernels.py",  # 115
    "test_two_nodes.py",  # 80
    "test_private_ray.py",  # 75
    "test_config_matrix.py",  # 75
    "test_full_disk.py",  # 75
    "test_launch.py",  # 65
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="module")
def tiny_loaded() -> tuple[Any, int, list[int], torch.Tensor, torch.Tensor]:
    """The packaged tiny model (float32, eval) with its pad and EOS ids, and six of its chat prompts, left-padded to
    uneven widths (rows 1 and 4 shortened): shared by a module's tests, so a test that changes the model copies it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zbench.data import synthetic_problems
    from zbench.engine.batches import left_pad
    from zbench.models import resolve_model, special_ids

    path = resolve_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    pad_id, eos_ids = special_ids(path)
    rows = synthetic_problems(6, seed=3, split="test")
    texts = [tok.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in rows]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids[1] = ids[1][3:]  # uneven widths: real left padding
    ids[4] = ids[4][5:]
    input_ids, mask = left_pad(ids, pad_id, multiple=1)
    return model, pad_id, eos_ids, input_ids, mask
