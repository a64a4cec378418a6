"""A case that prints MemoryError and is then SIGKILLed (like the kernel OOM killer)."""

import os
import signal

from _common import case_dir, step

step(case_dir(), 1)
print("MemoryError", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
