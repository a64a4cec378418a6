"""Worker set-up hooks for gpu_per_actor.py: what the probe of NOTES.md ran besides "none"."""

import sys


def old_zbench() -> None:
    """bfae291's hook: DeepSpeed's mlflow import turned off, then torch's build lock named."""
    sys.modules.setdefault("mlflow", None)  # type: ignore[arg-type]
    from zbench.engine import build_lock

    build_lock.install()


def cpp_ext() -> None:
    """torch's extension builder imported, nothing else."""
    import torch.utils.cpp_extension  # noqa: F401
