"""A case that makes one step and then hangs without a heartbeat (step timeout)."""

import time

from _common import case_dir, step

step(case_dir(), 1)
time.sleep(600)
