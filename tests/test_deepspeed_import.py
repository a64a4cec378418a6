"""How a worker imports DeepSpeed (`zbench.engine.ds_config.import_deepspeed`): its Muon optimizer's modules without
the torch.compile they apply as they load, which would load Inductor's compiler into every CPU worker; and nothing of
that left behind for the worker's own torch.compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
import torch
from zbench.engine.ds_config import import_deepspeed
import_deepspeed()
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # as DeepSpeed's ZeRO checks import it
after = {"inductor": "torch._inductor.compile_fx" in sys.modules,
         "muon_compiled": hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable"),
         "env": os.environ.get("TORCHDYNAMO_DISABLE"), "muon_class": MuonWithAuxAdam.__name__}
compiled = torch.compile(lambda x: x + 1)  # a worker's own compile afterwards still compiles
after["later_compiled"] = hasattr(compiled, "_torchdynamo_orig_callable")
print(json.dumps(after))
"""


def probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env["DS_ACCELERATOR"] = "cpu"
    if env_value is not None:
        env["TORCHDYNAMO_DISABLE"] = env_value
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env_value", [None, "0"])
def test_deepspeed_loads_without_compiling_muon_or_importing_inductor(env_value: str | None) -> None:
    """The Muon modules import uncompiled and Inductor's compiler (`compile_fx`) stays out until something compiles;
    the environment is as it was (unset, or the user's value), so the worker's own torch.compile compiles."""
    after = probe(env_value)
    assert after == {"inductor": False, "muon_compiled": False, "env": env_value, "muon_class": "MuonWithAuxAdam",
                     "later_compiled": True}
