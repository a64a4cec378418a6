"""Time `zbench plot` on a generated run root of 12 cases x 1000 steps (target: under 3 s).

    python tests/bench/bench_plot.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_analysis_runroot import FakeCase, make_run_root

from zbench.analyze.curves import plot_curves

CASES = tuple(FakeCase(f"zero{s}_{o}_{a}", s, "none" if o == "nooff" else "cpu", a)
              for a in ("ppo", "grpo") for s in (1, 2, 3) for o in ("nooff", "cpuoff"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_run_root(Path(tmp), CASES, steps=1000, device="cuda", matrix="twelve-case")
        start = time.perf_counter()
        result = plot_curves([root])
        elapsed = time.perf_counter() - start
    print(f"plot of {len(CASES)} cases x 1000 steps: {elapsed:.2f} s (target < 3 s) -> {result.png.name}")


if __name__ == "__main__":
    main()
