"""Which GPU each of two half-GPU Ray actors opens under a worker set-up hook (argv[1]: "none" or module.function).
Run from the project root with this folder on PYTHONPATH: python3 gpu_per_actor.py gpu_per_actor_hooks.cpp_ext"""
import json
import os
import sys

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote
class A:
    def __init__(self):
        import torch
        self.init_at_start = torch.cuda.is_initialized()
    def info(self):
        import torch
        return {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "init_before_actor": self.init_at_start,
                "count": torch.cuda.device_count(), "uuid": str(torch.cuda.get_device_properties(0).uuid)[-6:],
                "mods": [m for m in ("torch", "torch.utils.cpp_extension", "deepspeed") if m in sys.modules]}

hook = sys.argv[1]
ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
         runtime_env={"worker_process_setup_hook": hook} if hook != "none" else None, log_to_driver=False)
pg = placement_group([{"CPU": 1, "GPU": 1}] * 2, strategy="PACK")
ray.get(pg.ready())
acts = [A.options(num_gpus=0.5, num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
        for i in range(2)]
print(hook, json.dumps(ray.get([a.info.remote() for a in acts])), flush=True)
ray.shutdown()
