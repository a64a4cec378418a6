"""A case whose compiled function meets more input shapes than torch.compile's recompile limit allows: real Dynamo,
which warns once and runs the function eager from then on; then every step, and exit 0."""

import torch
from _common import case_dir, run_all

torch._dynamo.config.recompile_limit = 2
f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
for n in range(1, 5):
    f(torch.ones(n))
run_all(case_dir())
