"""Ray for one case: start (or join) a cluster, reserve one bundle per rank, place worker groups on the bundles.

`ZBENCH_RAY_ADDRESS` (set by the runner profile) names an existing cluster; empty means start a private one
on 127.0.0.1 whose temporary files live in `ZBENCH_RAY_TMPDIR` (or a folder derived from the case directory), recorded in
`<case>/ray_tmpdir` so that the harness can remove every Ray process the case started, even after a crash.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zbench.runroot import casedir


def ray_tmpdir(case_dir: Path) -> Path:
    """The case's Ray temp folder: the launcher's choice (ZBENCH_RAY_TMPDIR), else the case's own by the case-directory
    rule (short: Ray's socket paths must stay under ~107 characters, so not inside the case directory)."""
    if os.environ.get("ZBENCH_RAY_TMPDIR"):
        return Path(os.environ["ZBENCH_RAY_TMPDIR"])
    return casedir.ray_tmpdir(case_dir)


def free_port(host: str = "") -> int:
    """A TCP port free on this node right now, at `host` ("" = every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


PG_TIMEOUT = datetime.timedelta(minutes=30)  # DeepSpeed's default for its process groups


def join_process_group(backend: str, addr: str, port: int, rank: int, world_size: int,
                       device: Any = None) -> None:
    """Form torch.distributed's default group through a TCPStore whose server (on rank 0) listens at `addr` only;
    torch's own store would listen on every interface. DeepSpeed then adopts the group as it finds it. A process
    that already belongs to a default group (one process running several workers, as the benchmarks do) keeps it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    listen_fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(world_size)
        listen_fd = sock.detach()  # the store owns the socket from here on
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=PG_TIMEOUT, master_listen_fd=listen_fd)
    kwargs = {"device_id": device} if device is not None else {}  # binds NCCL to the rank's GPU, as DeepSpeed does
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT, **kwargs)


def cpu_threads_per_rank(local_ranks: int) -> int:
    """CPU threads each GPU rank may use: the cores this process may run on, shared among the ranks of this host.
    CPU Adam (offload) and host-side copies run on them: one thread each would serialize CPU Adam."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def worker_process_setup() -> None:
    """Run by Ray in each worker process of the case before it hosts a worker (`worker_process_setup_hook`).

    DeepSpeed's autotuner imports mlflow wherever it is installed (zbench's trackers extra installs it), only to log
    autotuning runs, which zbench never starts; that import alone costs each worker about 1.7 s of CPU, a fifth of
    a small case's start. Workers never log to a tracker (the controller does), so here `import mlflow` fails at
    once and DeepSpeed goes on without it.

    Nothing here may import torch: the hook runs before Ray gives the process its GPU. With torch's extension
    builder imported here, both ranks of a 2-GPU case ran on the first GPU although each one's
    `CUDA_VISIBLE_DEVICES` named its own (NCCL: "Duplicate GPU detected"; results/reference/h200x2-ppo-defaults-20261126).
    The workers take their build lock in `_Worker.__init__`, once the GPU is theirs."""
    sys.modules.setdefault("mlflow", None)  # type: ignore[arg-type]


# every worker process of a case, on a private Ray or a cluster, runs worker_process_setup first
JOB_RUNTIME_ENV = {"worker_process_setup_hook": f"{__name__}.{worker_process_setup.__name__}"}


def start_ray(case_dir: Path, world_size: int, on_cuda: bool) -> None:
    """Start a private Ray on loopback, or connect to the cluster in ZBENCH_RAY_ADDRESS."""
    address = os.environ.get("ZBENCH_RAY_ADDRESS", "").strip()
    if address:
        node_ip = os.environ.get("ZBENCH_RAY_NODE_IP", "").strip()
        # on a multi-homed host (or a cluster on loopback) Ray's guess of this node's address can be wrong
        ray.init(address=address, log_to_driver=True, runtime_env=dict(JOB_RUNTIME_ENV),
                 **({"_node_ip_address": node_ip} if node_ip else {}))
        return
    tmp = ray_tmpdir(case_dir)
    casedir.record_ray_tmpdir(case_dir, tmp)
    kwargs: dict[str, Any] = {
        "address": "local",
        "_node_ip_address": "127.0.0.1",  # stays loopback: see zbench.engine.__main__ (private_ray_env)
        "include_dashboard": False,
        # no Prometheus endpoints: the dashboard agent's metrics exporter answers anyone who connects. No idle
        # workers started ahead for the driver: every actor here asks for its own environment (`WorkerGroup`), so
        # none would ever run one; on a loaded 2-core machine each cost a case about 1.8 s of CPU
        "_system_config": {"enable_metrics_collection": False, "prestart_worker_first_driver": False},
        "_temp_dir": str(casedir.prepare_ray_tmpdir(tmp)),
        "log_to_driver": True,
        # logical CPUs: two workers per rank (actor + critic) and the controller, whatever the core count
        "num_cpus": max(os.cpu_count() or 1, 2 * world_size + 1),
        "object_store_memory": 1 << 30,
        "runtime_env": dict(JOB_RUNTIME_ENV),
    }
    if not on_cuda:
        kwargs["num_gpus"] = 0
    ray.init(**kwargs)


def _node_id(actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _pid(actor: Any) -> int:
    return os.getpid()


class WorkerGroup:
    """One Ray actor per rank, each pinned to its bundle of a shared placement group."""

    def __init__(self, cls: type, pg: Any, world_size: int, share: float, on_cuda: bool,
                 env: dict[str, str], init_args: tuple):
        remote_cls = ray.remote(cls)
        self.name = cls.__name__
        self.handles = [
            remote_cls.options(
                num_cpus=share,
                num_gpus=share if on_cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env},
            ).remote(*init_args[:1], rank, world_size, *init_args[1:])
            for rank in range(world_size)
        ]

    def rendezvous(self) -> None:
        """Form this group's torch.distributed group at an address and port chosen by its rank 0."""
        addr, port = ray.get(self.handles[0].address.remote())
        ray.get([h.join.remote(addr, port) for h in self.handles])

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call `method` with the same arguments on every rank; wait for all."""
        return ray.get([getattr(h, method).remote(*args) for h in self.handles])

    def call_sharded(self, method: str, shards: list[Any], *args: Any) -> list[Any]:
        """Call `method` on every rank with its own shard; wait for all."""
        return self.collect(self.submit_sharded(method, shards, *args))

    def submit_sharded(self, method: str, shards: list[Any], *args: Any) -> list[Any]:
        """Start `method` on every rank with its own shard, and return at once: `ray.get` the returned references
        for the results. A rank runs its calls in the order they were made, so a later call on this group runs
        after this one."""
        return [getattr(h, method).remote(s, *args) for h, s in zip(self.handles, shards, strict=True)]

    @staticmethod
    def collect(runs: list[Any]) -> list[Any]:
        """The results of calls started with `submit_sharded`, in rank order; waits for all."""
        return ray.get(runs)

    def nodes(self) -> list[str]:
        """The Ray node id each rank runs on, in rank order."""
        return ray.get([h.__ray_call__.remote(_node_id) for h in self.handles])

    def pids(self) -> list[int]:
        """The process id of each rank's worker, in rank order."""
        return ray.get([h.__ray_call__.remote(_pid) for h in self.handles])

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)


class Placement:
    """The case's placement group: one bundle per rank (a GPU, or a worker slot on a CPU-only machine)."""

    def __init__(self, world_size: int, on_cuda: bool, groups_per_bundle: int):
        self.world_size, self.on_cuda = world_size, on_cuda
        self.share = 1.0 / groups_per_bundle
        bundle = {"CPU": 1.0, "GPU": 1.0} if on_cuda else {"CPU": 1.0}
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=300)
        if not ready:
            raise RuntimeError(
                f"Ray could not reserve {world_size} bundles of {bundle} in 300 s; cluster resources: "
                f"{ray.cluster_resources()} (lower trainer.world_size or add nodes)")

    def group(self, cls: type, env: dict[str, str], *init_args: Any) -> WorkerGroup:
        """Place one `cls` actor per rank and form its process group."""
        group = WorkerGroup(cls, self.pg, self.world_size, self.share, self.on_cuda, env, init_args)
        group.rendezvous()
        return group

    def remove(self) -> None:
        remove_placement_group(self.pg)
