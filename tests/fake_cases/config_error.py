"""A case whose config is rejected: the engine exits 2."""

import sys

print(
    "ValueError: config.yaml: zero.offload 'cpu' needs zero.stage >= 1 (got 0); valid: none, auto", flush=True
)
sys.exit(2)
