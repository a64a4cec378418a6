"""zbench: which DeepSpeed ZeRO configuration to use for RL post-training, and what each one costs.

The package reads in the order data flows through it:

    cli.py      the command line (thin: parse, call one function, print)
    harness/    matrix -> cases, one supervised process per case (launch), runner profiles, progress, tune
    engine/     one case: Ray placement, DeepSpeed actor/critic, rollouts, the PPO/GRPO step loop
    runroot/    what a run leaves on disk: the case-directory contract, run root + lock, summary.tsv, merge, reading
    analyze/    reading run roots: curves, report, compare, parity, the ZeRO memory model

beside the pieces every layer shares: the typed case config (config.py), the datasets and models a case trains
(data.py, models.py), stack dumps of hung processes and which processes belong to a case (stacks.py, procs.py), the
environment report (env.py) and the bare-DeepSpeed floors (bench.py).
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

SPEC_KINDS = ("matrices", "runners", "analysis")


def shipped_specs(kind: str) -> Path:
    """The folder of shipped YAML specs of one kind (``matrices``, ``runners``, ``analysis``): the installed
    package data ``zbench.<kind>``, else the source checkout's top-level ``<kind>/``."""
    if kind not in SPEC_KINDS:
        raise ValueError(f"unknown spec kind {kind!r}: one of {', '.join(SPEC_KINDS)}")
    from importlib import resources

    try:
        shipped = resources.files(f"zbench.{kind}")
        if shipped.is_dir() and any(p.name.endswith(".yaml") for p in shipped.iterdir()):
            return Path(str(shipped))
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / kind
