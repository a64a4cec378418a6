"""A case that completes every step and result.json, then aborts at interpreter exit."""

import os

from _common import case_dir, run_all

run_all(case_dir())
print("terminate called without an active exception", flush=True)
os.abort()
