"""A case that dies like a CUDA out-of-memory error in its second step."""

import sys

from _common import case_dir, step

step(case_dir(), 1)
print("Traceback (most recent call last):", flush=True)
print(
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 79.19 GiB of which 1.06 GiB is free.",
    flush=True,
)
sys.exit(1)
