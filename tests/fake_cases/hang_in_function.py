"""A case that registers for stack dumps as the engine does, makes one step, then hangs inside a named function."""

import time

from _common import case_dir, step

from zbench.stacks import enable_stack_dumps


def blocked_in_fake_engine() -> None:
    time.sleep(600)


enable_stack_dumps(case_dir())
step(case_dir(), 1)
blocked_in_fake_engine()
