"""vLLM tensor parallelism as the `vllm` rollout backend runs it, without Ray or DeepSpeed: two processes open an
NCCL group (as DeepSpeed does), each builds the same `external_launcher` engine over it, then generate, sleep,
wake, push weights, generate again. Each stage prints a line; a stage that hangs prints every thread's stack
after --hang-s seconds and the process exits.

    python benchmarks/vllm_tp_probe.py --visible isolated            # each rank sees only its own GPU (Ray)
    python benchmarks/vllm_tp_probe.py --visible shared --eager      # both GPUs visible; no CUDA graphs

Needs vLLM and two CUDA GPUs. Prints one JSON line at the end: the variant, the last stage each rank reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time


def _rank_main(args: argparse.Namespace) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # re-armed after every stage

    def stage(name: str) -> None:
        print(f"[rank {rank}] {time.monotonic() - t0:7.1f}s stage {name}", flush=True)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(args.hang_s, exit=True)

    t0 = time.monotonic()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    stage(f"nccl world ok ({x.item():g}), devices visible {torch.cuda.device_count()}")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from zbench.models import resolve_model

    path = str(resolve_model(args.model))
    kwargs: dict = {"enforce_eager": args.eager}
    if args.no_async:
        kwargs["async_scheduling"] = False
    llm = LLM(model=path, dtype="bfloat16", seed=1, gpu_memory_utilization=0.2, enable_sleep_mode=not args.no_sleep,
              max_model_len=512, enable_prefix_caching=True, tensor_parallel_size=2,
              distributed_executor_backend="external_launcher", disable_custom_all_reduce=True, **kwargs)
    stage("engine built")
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 10 for j in range(16 + i)]) for i in range(16)]
    params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=100 + i, ignore_eos=True)
              for i in range(16)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = [list(o.outputs[0].token_ids) for o in outs]
    stage(f"generated {sum(map(len, first))} tokens")
    if not args.no_sleep:
        llm.sleep(level=2)
        stage("asleep")
        llm.wake_up(tags=["weights"])
        stage("weights awake")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    llm.apply_model(lambda model: model.load_weights(iter(list(hf.named_parameters()))))
    stage("weights pushed")
    if not args.no_sleep:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["kv_cache"])
        stage("kv cache awake")
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, params, use_tqdm=False)
    again = [list(o.outputs[0].token_ids) for o in outs]
    stage(f"generated again, same tokens as before the push: {again == first}")
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    print(f"[rank {rank}] DONE", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--visible", choices=("isolated", "shared"), default="isolated",
                    help="isolated: each rank sees only its own GPU (as under Ray); shared: both, LOCAL_RANK picks")
    ap.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile, no CUDA graphs")
    ap.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    ap.add_argument("--no-sleep", action="store_true", help="build without sleep mode and skip sleep/wake")
    ap.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b or a local Hugging Face directory")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--hang-s", type=float, default=90.0, help="a stage taking longer prints stacks and exits")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        _rank_main(args)
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[:2]
    if len(visible) < 2:
        sys.exit(f"needs two GPUs; CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} lists one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if args.visible == "isolated":
            env.update(CUDA_VISIBLE_DEVICES=visible[rank], LOCAL_RANK="0")
        else:
            env.update(CUDA_VISIBLE_DEVICES=",".join(visible), LOCAL_RANK=str(rank))
        log = open(f"/tmp/vllm-tp-probe-rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", *sys.argv[1:]], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    def stop(signum: int, _frame: object) -> None:  # stopped from outside (timeout): take the ranks down too
        for p in procs:
            p.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + 20 * args.hang_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    reached = []
    for rank, log in enumerate(logs):
        log.close()
        with open(log.name) as f:
            text = f.read()
        print(f"===== rank {rank} (exit {procs[rank].returncode})\n{text[-12000:]}", flush=True)
        stages = [line.split("stage ", 1)[1] for line in text.splitlines() if " stage " in line]
        reached.append("DONE" if "DONE" in text else (stages[-1] if stages else "none"))
    variant = {k: getattr(args, k) for k in ("visible", "eager", "no_async", "no_sleep", "model", "tokens")}
    print(json.dumps({"variant": variant, "reached": reached,
                      "ok": all(p.returncode == 0 for p in procs) and reached == ["DONE", "DONE"]}), flush=True)


if __name__ == "__main__":
    main()
