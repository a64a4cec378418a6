"""The worker heap: collector pauses are measured, and what is alive after the first step is frozen."""

from __future__ import annotations

import gc

from zbench.engine.heap import GcClock, freeze_survivors


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_clock_adds_up_collections_and_resets() -> None:
    clock = GcClock()
    try:
        keep = [Node() for _ in range(50_000)]
        gc.collect()
        gc.collect()
        assert clock.collections >= 2
        paused = clock.take()
        assert paused > 0.0
        assert clock.take() == 0.0 and clock.collections == 0
        del keep
    finally:
        clock.close()
    assert clock._callback not in gc.callbacks


def test_frozen_survivors_are_not_walked_and_later_garbage_is_still_freed() -> None:
    survivors = [Node() for _ in range(20_000)]
    try:
        frozen = freeze_survivors()
        assert frozen >= len(survivors)
        walked = {id(o) for o in gc.get_objects()}  # the generations a collection walks
        assert id(survivors[0]) not in walked and id(survivors[-1]) not in walked
        [Node() for _ in range(1_000)]  # cycles made after the freeze
        assert gc.collect() >= 1_000
    finally:
        gc.unfreeze()
    assert id(survivors[0]) in {id(o) for o in gc.get_objects()}
