"""A case that starts a real private Ray (temp dir ZBENCH_RAY_TMPDIR), an actor, and then dies by SIGKILL.

Ray's raylet and GCS outlive their driver; the launcher must remove them.
"""

import os
import signal
import sys

import ray
from _common import case_dir, step

ray.init(
    address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1, num_gpus=0,
    _temp_dir=os.environ["ZBENCH_RAY_TMPDIR"], object_store_memory=80 << 20,
)  # fmt: skip


@ray.remote(num_cpus=1)
class Worker:
    def pid(self) -> int:
        return os.getpid()


worker = Worker.remote()
print(f"worker pid {ray.get(worker.pid.remote())}", flush=True)
step(case_dir(), 1)
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)
