"""Faults injected on purpose (`--set trainer.fault=KIND@STEP`), so that a test or a soak sees the harness recover
from the failures long runs meet. A fault fires at the start of its step, on the case's first attempt only
(`ZBENCH_ATTEMPT`, set by the launcher), so that a retry or `zbench resume` shows the recovery.

    crash        an exception in the trainer                         -> failed, the exception line as reason
    hang         rank 0 enters a barrier the other ranks never reach -> timeout (step timeout), stacks in train.log
    oom          rank 0 raises the out-of-memory error a device does  -> oom, not retried
    worker_exit  the last rank's worker process exits                 -> failed with a lost worker, retried
    node_loss    every worker on the last rank's node exits           -> failed with a lost worker, retried
    slow         the step takes SLOW_FAULT_S seconds longer           -> completed
"""

from __future__ import annotations

import os
import time
from typing import Any

from zbench.procs import ATTEMPT_ENV  # 1 when the engine runs by hand

SLOW_FAULT_S = 15.0  # how much longer a `slow` step takes


def _hang_in_barrier(worker: Any) -> None:
    import torch.distributed as dist

    dist.barrier()  # the other ranks never arrive


def _raise_oom(worker: Any, step: int) -> None:
    import torch

    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by trainer.fault=oom@{step})"
    )


def _exit_worker(worker: Any) -> None:
    print(f"[fault] {type(worker).__name__} rank {worker.rank}: exiting (injected)", flush=True)
    os._exit(1)


def maybe_inject(trainer: Any, step: int) -> None:
    """Fire the case's fault if it is due at ``step`` of the first attempt; nothing when none is configured."""
    plan = trainer.cfg.trainer.fault_plan()
    if plan is None or plan[1] != step or os.environ.get(ATTEMPT_ENV, "1") != "1":
        return
    import ray

    kind = plan[0]
    print(f"[fault] injecting {kind} at step {step}", flush=True)
    ranks = trainer.policy.handles
    if kind == "crash":
        raise RuntimeError(f"injected fault: crash at step {step}")
    if kind == "slow":
        time.sleep(SLOW_FAULT_S)
    elif kind == "hang":
        ray.get(ranks[0].__ray_call__.remote(_hang_in_barrier))
    elif kind == "oom":
        ray.get(ranks[0].__ray_call__.remote(_raise_oom, step))
    elif kind == "worker_exit":
        ray.get(ranks[-1].__ray_call__.remote(_exit_worker))
    elif kind == "node_loss":
        groups = [g for g in (trainer.policy, trainer.critic) if g is not None]
        workers = [h for g in groups for h in g.handles]
        nodes = [n for g in groups for n in g.nodes()]
        lost = nodes[len(ranks) - 1]
        print(f"[fault] node {lost}: stopping its {nodes.count(lost)} workers", flush=True)
        # all at once, then wait: the first exit must not stop the others from being told
        ray.get([w.__ray_call__.remote(_exit_worker) for w, n in zip(workers, nodes, strict=True) if n == lost])
