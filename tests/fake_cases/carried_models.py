"""A case served by a process that still holds a model an earlier trial released (something kept a reference):
the real release check (`zbench.engine.workers.report_carried`) prints its warning; then every step, and exit 0."""

import weakref

import torch
from _common import case_dir, run_all

from zbench.engine import workers

kept = torch.nn.Linear(512, 1024)  # 2 MB of float32 parameters
workers._RELEASED.append(weakref.ref(kept))  # as `Worker.release` records a model it drops
workers.report_carried("actor", 0)
run_all(case_dir())
