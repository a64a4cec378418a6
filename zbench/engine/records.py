"""What a case leaves behind each step: `metrics.jsonl`, the `step:N - key:value` log line, the heartbeat,
and at the end `result.json`. Plus the two derived performance figures: throughput and MFU."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zbench.env import VERSIONED_PACKAGES, package_version
from zbench.runroot import casedir

# Dense bf16 peak FLOP/s by GPU name fragment (vendor datasheets), for perf/mfu/actor.
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "B100": 1750e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 70e12, "A10": 125e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12,
}


def gpu_memory_in_use_gb(device: Any = None) -> float:
    """Memory in use on a GPU by every process, as nvidia-smi shows it (cudaMemGetInfo), in GiB."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def peak_flops(gpu_name: str | None) -> float | None:
    """Dense bf16 peak of a GPU by name, or None when unknown (MFU is then not reported)."""
    if not gpu_name:
        return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in gpu_name:
            return PEAK_BF16_FLOPS[key]
    return None


def training_flops(n_params: int, config: Any, lengths: Sequence[int], head_tokens: int) -> float:
    """Model FLOPs of one forward and backward of a causal LM (`n_params` parameters, transformers `config`) over
    sequences of these lengths, counted as PaLM counts them (its appendix B) where the work is needed: 6 a token for
    each parameter of the decoder's matrix multiplies; 6 a token for each of the head's (vocabulary x hidden) only
    for the `head_tokens` whose logits the loss needs (an RL update: the responses'; an input embedding is looked
    up, not multiplied); and the attention's scores and weighted sum, 12 L A T a token of a T-token sequence, where
    A is the attention's width (heads x head dim, which a model like Qwen3 sets apart from its hidden size) and
    every token attends the whole sequence (no causal halving). Padding counts nothing."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab_by_hidden = int(text.vocab_size) * int(text.hidden_size)
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    decoder = n_params - vocab_by_hidden * (1 if tied else 2)  # less the embedding and the head (one matrix, tied)
    return (6.0 * decoder * sum(lengths) + 6.0 * vocab_by_hidden * head_tokens
            + 12.0 * int(text.num_hidden_layers) * attention_width(text) * sum(t * t for t in lengths))


def attention_width(config: Any) -> int:
    """Heads x head dim of a transformers (text) config: the width the attention's scores and sums run over."""
    heads = int(config.num_attention_heads)
    return heads * int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def versions() -> dict[str, str | None]:
    """Installed versions of the packages a result depends on."""
    return {pkg: package_version(pkg) for pkg in VERSIONED_PACKAGES}


def _fmt(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e12):
        return str(int(value))
    return f"{value:.6g}"


class Records:
    """Append-only step records of one case."""

    def __init__(self, case_dir: Path, console: bool = True):
        self.case_dir = case_dir
        self.console = console  # trainer.logger names console: each step's line goes to train.log
        self.metrics_path = case_dir / casedir.METRICS
        self.heartbeat_path = case_dir / casedir.HEARTBEAT

    def beat(self) -> None:
        """Tell the watchdog this case is alive."""
        self.heartbeat_path.touch()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed case redoes them); also drops a torn last line."""
        if not self.metrics_path.exists():
            return
        kept = [r for r in casedir.read_metrics(self.case_dir).records if r["step"] <= step]
        casedir.atomic_write_text(self.metrics_path, "".join(f"{json.dumps(r)}\n" for r in kept))

    def step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Append one step's metrics, print its log line, beat; returns the metrics as recorded (finite floats)."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        record = {"step": step, "time": time.time(), **dict(sorted(clean.items()))}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.console:
            print(f"step:{step} - " + " - ".join(f"{k}:{_fmt(v)}" for k, v in sorted(clean.items())), flush=True)
        self.beat()
        return clean

    def result(self, info: dict[str, Any]) -> None:
        """The final record: its presence with all steps done marks the case completed."""
        casedir.write_result(self.case_dir, info)
