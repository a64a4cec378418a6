"""DeepSpeed configs built from a case: ZeRO stage, effective offload, precision, optimizer, batch semantics; and
the loop of one optimizer step over a mini-batch's micro-batches that drives an engine built from them."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from zbench.config import Offload, ZeroConfig

# DeepSpeed's Muon optimizer: this module of it compiles functions with torch.compile as it is imported
MUON_COMPILED_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, then its Muon optimizer's modules with TorchDynamo off (`TORCHDYNAMO_DISABLE`, which
    `torch.compile` reads as it decorates), so that their three Newton-Schulz and update functions stay plain ones.

    DeepSpeed 0.19 imports those modules in every ZeRO engine (its optimizer check, its gradient reduction), and
    compiling the functions loads Inductor's compiler (`torch._inductor.compile_fx` and what it imports): about 2.4 s
    of CPU in each worker process, a quarter of what a small CPU case's workers spent before their first step.
    zbench never trains with Muon; where a worker compiles its own layers (on CUDA), the compiler loads then. Only the
    Muon import runs with the switch set: DeepSpeed itself, imported first, decorates with it unset."""
    import deepspeed

    if MUON_COMPILED_MODULE not in sys.modules:
        before = os.environ.get("TORCHDYNAMO_DISABLE")
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        try:
            with contextlib.suppress(ImportError):  # a DeepSpeed without Muon has nothing to import
                __import__("deepspeed.runtime.zero.muon.muon_optimizer")
        finally:
            if before is None:
                os.environ.pop("TORCHDYNAMO_DISABLE", None)
            else:
                os.environ["TORCHDYNAMO_DISABLE"] = before
    return deepspeed


def nvme_folder(zero: ZeroConfig, case_dir: Path) -> str:
    """Where NVMe offload swaps to: the configured folder, or `<case dir>/nvme`."""
    return zero.nvme_path or str(case_dir / "nvme")


def zero_section(zero: ZeroConfig, offload: Offload, *, on_cuda: bool, nvme_path: str) -> dict[str, Any]:
    """The `zero_optimization` block for a stage and its effective offload."""
    section: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm and on_cuda,
        "contiguous_gradients": True,
        "reduce_bucket_size": zero.reduce_bucket_size,
    }
    if zero.stage == 3:
        section.update(
            stage3_prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=10_000,  # small tensors (norms, biases) stay resident
            stage3_gather_16bit_weights_on_model_save=False,
        )
    pin = on_cuda  # pinned host memory only helps (and only exists) with a GPU
    if offload.optimizer != "none":
        section["offload_optimizer"] = {"device": offload.optimizer, "pin_memory": pin}
        if offload.optimizer == "nvme":
            section["offload_optimizer"]["nvme_path"] = nvme_path
    if offload.params != "none":
        section["offload_param"] = {"device": offload.params, "pin_memory": pin}
        if offload.params == "nvme":
            section["offload_param"]["nvme_path"] = nvme_path
    return section


def training_config(
    zero: ZeroConfig,
    offload: Offload,
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    lr: float,
    weight_decay: float,
    grad_clip: float,
    bf16: bool,
    on_cuda: bool,
    nvme_path: str,
) -> dict[str, Any]:
    """Config for a trained model (actor or critic).

    The optimizer follows from where its states live: DeepSpeedCPUAdam under offload (DeepSpeed picks it for
    `AdamW` when the optimizer is offloaded), FusedAdam on CUDA, torch's AdamW on a CPU-only machine.
    """
    offloaded = offload.optimizer != "none"
    params: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "betas": [0.9, 0.999], "eps": 1e-8}
    if not on_cuda and not offloaded:
        params["torch_adam"] = True
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero_section(zero, offload, on_cuda=on_cuda, nvme_path=nvme_path),
        "optimizer": {"type": "AdamW", "params": params},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def inference_config(zero: ZeroConfig, offload: Offload, *, world_size: int, bf16: bool, on_cuda: bool,
                     nvme_path: str) -> dict[str, Any]:
    """Config for the frozen reference under ZeRO-3: parameters partitioned (and offloaded) like the actor's."""
    section = zero_section(zero, Offload("none", offload.params), on_cuda=on_cuda, nvme_path=nvme_path)
    return {
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": bf16},
        "zero_optimization": section,
        "steps_per_print": 10**9,
    }


def accumulated_step(engine: Any, losses: Iterable[Any], coalesce: bool) -> None:
    """One optimizer step of DeepSpeed `engine` over a mini-batch: the backward of each of `losses` (each computed as
    it is drawn, so one micro-batch's activations live at a time). As DeepSpeed's usual loop, a `step` after each
    backward, the optimizer stepping at its accumulation boundary; with `coalesce` (`zero.coalesce_grad_reduction`)
    every backward inside DeepSpeed's coalesced-reduction block, which reduces the gradients once as it closes, then
    a `step` for each micro-batch: the first ones only count it, the last reaches the boundary."""
    count = 0
    with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
        for loss in losses:
            engine.backward(loss)
            count += 1
            if not coalesce:
                engine.step()
    if coalesce:
        for _ in range(count):
            engine.step()
