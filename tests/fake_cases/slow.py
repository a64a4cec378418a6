"""A case that keeps its heartbeat fresh but never finishes (case timeout)."""

from _common import case_dir, step

for n in range(1, 10_000):
    step(case_dir(), n, delay=0.2)
