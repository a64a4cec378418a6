"""A case whose driver waits on a real Ray actor that hangs: both registered for stack dumps, as the engine's
trainer and workers are."""

import os
import time

import ray
from _common import case_dir, step

from zbench.stacks import enable_stack_dumps

enable_stack_dumps(case_dir())
ray.init(
    address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1, num_gpus=0,
    _temp_dir=os.environ["ZBENCH_RAY_TMPDIR"], object_store_memory=80 << 20, log_to_driver=True,
)  # fmt: skip


@ray.remote(num_cpus=1)
class Worker:
    def __init__(self, cdir: str) -> None:
        enable_stack_dumps(cdir)

    def ready(self) -> bool:
        return True

    def stuck_in_worker(self) -> None:
        time.sleep(600)


def waiting_for_worker(worker) -> None:
    ray.get(worker.stuck_in_worker.remote())


worker = Worker.remote(str(case_dir().resolve()))
ray.get(worker.ready.remote())
step(case_dir(), 1)
waiting_for_worker(worker)
