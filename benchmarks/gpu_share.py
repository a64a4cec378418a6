"""Two processes on one GPU as PPO's overlap puts them there: a rollout decoding 32 rows in one process while a
critic update (a Qwen3 trunk with a value head, activation checkpointing, AdamW) runs in another. Each round,
both start at a shared barrier; the `decode` process samples one rollout (zbench's CUDA-graph decode loop, or with
`--engine vllm` a case's vLLM engine) and the `train` process takes one update step, then idles until the next
round. The update's process builds its model only once the decoder is warm, as a case's engine starts before its
training. Run with and without NVIDIA MPS in front of the GPU to see what sharing costs each:

    b=$(mktemp -d)
    python benchmarks/gpu_share.py decode --barrier "$b" --parties 2 --active 0:8 --label shared &
    python benchmarks/gpu_share.py train --barrier "$b" --parties 2 --active 2:10 --label shared

`--active A:B` names the rounds a process works in, so one launch measures each alone and both together (e.g.
decode in rounds 0-7, train in rounds 2-9: rounds 0-1 time the rollout alone, 8-9 the update alone). One JSON line
per process on stdout: its label, role and the seconds of each round it worked in (`mps`: whether
`CUDA_MPS_PIPE_DIRECTORY` was set; the daemon's log says which processes connected).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def barrier(folder: Path, name: str, role: str, parties: int, timeout_s: float = 240.0) -> None:
    """Wait until `parties` processes have reached the barrier `name` (a file each in `folder`); a process that
    died before it ends the wait with an error after `timeout_s`."""
    (folder / f"{name}.{role}").touch()
    start = time.perf_counter()
    while len(list(folder.glob(f"{name}.*"))) < parties:
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"--barrier {folder}: {name}: the other process did not arrive in {timeout_s:.0f} s")
        time.sleep(0.0005)


def vllm_decoder(args: argparse.Namespace):
    """A case's vLLM engine (`benchmarks/vllm_profile.py`, in this script's folder) and one step's GSM8K prompts;
    each rollout starts from an empty prefix cache, as the trainer's do after the weight push."""
    from vllm_profile import engine_and_batch

    args.n = 1
    _, rollout, ids, mask, _ = engine_and_batch(args, {"name": "in-process", "engine": {}})

    def generate(seed: int) -> None:
        rollout.llm.reset_prefix_cache()
        rollout.generate(ids, mask, seed, sleep=False)

    return generate


def decoder(args: argparse.Namespace, device: torch.device):
    if args.engine == "vllm":
        return vllm_decoder(args)
    from transformers import AutoModelForCausalLM

    from zbench.engine.rollout import GraphDecoder
    from zbench.models import resolve_model

    lm = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.bfloat16).to(device).eval()
    graph = GraphDecoder(lm, compile=True)
    torch.manual_seed(0)
    ids = torch.randint(10, 5000, (args.batch, args.width), device=device)
    mask = torch.ones_like(ids)

    def rollout(seed: int) -> None:
        graph.generate(ids, mask, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, pad_id=0,
                       eos_ids=[], generator=torch.Generator(device).manual_seed(seed))

    return rollout


def trainer(args: argparse.Namespace, device: torch.device):
    from transformers import AutoModel

    from zbench.models import resolve_model

    trunk = AutoModel.from_pretrained(resolve_model(args.model), dtype=torch.float32).to(device)
    trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trunk.train()
    head = torch.nn.Linear(trunk.config.hidden_size, 1).to(device)
    params = [*trunk.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    torch.manual_seed(0)
    ids = torch.randint(10, 5000, (args.batch, args.width + args.new_tokens), device=device)
    target = torch.randn(ids.shape, device=device)

    def step(seed: int) -> None:
        for start in range(0, ids.shape[0], args.micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = trunk(input_ids=ids[start:start + args.micro]).last_hidden_state
                values = head(hidden).squeeze(-1).float()
            torch.nn.functional.mse_loss(values, target[start:start + args.micro]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("decode", "train"))
    parser.add_argument("--barrier", type=Path, required=True, help="a fresh folder the two processes share")
    parser.add_argument("--parties", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--engine", choices=("graph", "vllm"), default="graph",
                        help="decode: zbench's CUDA-graph loop (random prompts of --width) or a case's vLLM engine "
                             "(--batch prompts from --data, as PPO samples them)")
    parser.add_argument("--data", default="synthetic", help="vllm: a GSM8K parquet from `zbench data gsm8k`, or synthetic")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--active", default="0:10", help="the rounds A:B (A <= round < B) this process works in; in "
                        "the others it only meets the barrier, so the other process is measured alone")
    parser.add_argument("--batch", type=int, default=32, help="rows decoded / sequences in the update")
    parser.add_argument("--width", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro", type=int, default=32, help="update micro-batch (sequences)")
    args = parser.parse_args()
    args.prompts = args.batch

    device = torch.device("cuda")
    args.barrier.mkdir(parents=True, exist_ok=True)
    if any(args.barrier.glob("end.*")):  # its barriers would all pass at once
        raise SystemExit(f"--barrier {args.barrier}: holds a finished run's files; give each pair a fresh folder")
    if args.role == "train":
        barrier(args.barrier, "decoder-ready", args.role, args.parties)
    work = decoder(args, device) if args.role == "decode" else trainer(args, device)
    work(0)  # compile / warm up before the first barrier
    torch.cuda.synchronize()
    if args.role == "decode":
        barrier(args.barrier, "decoder-ready", args.role, args.parties)
    first, last = (int(x) for x in args.active.split(":"))
    times = []
    for i in range(args.rounds):
        barrier(args.barrier, f"round{i}", args.role, args.parties)
        if not first <= i < last:
            continue
        start = time.perf_counter()
        work(1 + i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    barrier(args.barrier, "end", args.role, args.parties)
    print(json.dumps({"label": args.label, "role": args.role, "parties": args.parties,
                      "mps_thread_pct": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                      "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "engine": args.engine, "batch": args.batch,
                      "width": args.width, "new_tokens": args.new_tokens, "active": args.active, "seconds": times,
                      "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
                      "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
