"""A case that loses a Ray worker on its first attempt and succeeds on the next."""

import sys

from _common import case_dir, run_all, step

cdir = case_dir()
marker = cdir / "flaky_marker"
if not marker.exists():
    marker.touch()
    step(cdir, 1)
    print(
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.", flush=True
    )
    sys.exit(1)
run_all(cdir)
