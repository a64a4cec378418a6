"""A case SIGKILLed after its first step without a word, as the kernel's OOM killer ends a process."""

import os
import signal

from _common import case_dir, step

step(case_dir(), 1)
os.kill(os.getpid(), signal.SIGKILL)
