"""What a rollout with the colocated vLLM engine costs with and without the sampled tokens' log-probs
(`rollout.log_probs`), on one GPU: one engine built as a case builds it (`zbench.engine.vllm_rollout.build`),
GSM8K prompts repeated `--n` times, and the engine's own generate call. With log-probs, vLLM computes a
log-softmax over the vocabulary every decode step and builds a Python object per sampled token.

    python benchmarks/vllm_sampling.py --model qwen3-0.6b --data /tmp/zbench-gsm8k/train.parquet \
        --prompts 32 --n 4 --new-tokens 512                 # a GPU with vLLM

Each variant is timed `--repeats` times after one warm-up, the engine awake throughout (median seconds, generated
tokens per second, mean response length); then whether the same seed gives the same tokens and another seed
other tokens; last, what the engine's sleep (level 2) and wake-up take, which a case's `gen` phase also pays
every step. One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout holds this script's JSON lines only


def _config(args: argparse.Namespace) -> Any:
    from zbench.config import from_dict

    return from_dict({
        "algorithm": "grpo", "seed": 7777, "model": {"path": args.model},
        "data": {"train_files": args.data, "max_prompt_length": 512},
        "rollout": {"backend": "vllm", "n": args.n, "max_new_tokens": args.new_tokens, "kv_cache_fit": True},
        "actor": {"ppo_mini_batch_size": args.prompts, "micro_batch_size_per_gpu": args.n},
        "trainer": {"world_size": 1, "train_batch_size": args.prompts},
    })


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--data", default="synthetic", help="a GSM8K parquet from `zbench data gsm8k`")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from zbench.data import load_prompts, synthetic_problems
    from zbench.engine import vllm_rollout
    from zbench.engine.batches import left_pad
    from zbench.engine.trainer import PromptStream
    from zbench.models import resolve_model, special_ids

    cfg = _config(args)
    model_path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id, eos_ids = special_ids(model_path)
    d = cfg.data
    rows = synthetic_problems(4 * args.prompts, 0, "train") if d.train_files == "synthetic" else load_prompts(d.train_files)
    stream = PromptStream(rows[: 8 * args.prompts], tok, args.prompts, cfg.seed, True, d.max_prompt_length)
    ids, mask = left_pad([stream.ids[i] for i in stream.indices(1) for _ in range(args.n)], pad_id)
    tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
    start = time.perf_counter()
    rollout = vllm_rollout.build(model_path, cfg, pad_id, eos_ids, 0, tied)
    print(json.dumps({"measure": "engine_start_s", "value": round(time.perf_counter() - start, 2)}), flush=True)
    device = torch.cuda.get_device_name()

    def generate(seed: int) -> dict[str, torch.Tensor]:
        return rollout.generate(ids, mask, seed, sleep=False)

    for log_probs in (True, False):
        rollout.log_probs = log_probs
        times, lengths = [], []
        for rep in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = generate(1000 + rep)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            lengths.append(float(out["response_mask"].sum(1).float().mean()))
        best = statistics.median(times[1:])
        tokens = statistics.mean(lengths[1:]) * len(ids)
        print(json.dumps({"measure": "generate", "log_probs": log_probs, "sequences": len(ids),
                          "median_s": round(best, 3), "all_s": [round(t, 3) for t in times[1:]],
                          "cold_s": round(times[0], 3), "generated_tokens_per_s": round(tokens / best),
                          "mean_response_len": round(statistics.mean(lengths[1:]), 1),
                          "ms_per_decode_step": round(1000 * best / args.new_tokens, 2), "device": device}),
              flush=True)

    rollout.log_probs = False
    a, b, c = generate(42)["responses"], generate(42)["responses"], generate(43)["responses"]
    print(json.dumps({"measure": "seed_determinism", "same_seed_same_tokens": bool(torch.equal(a, b)),
                      "other_seed_other_tokens": not bool(torch.equal(a, c))}), flush=True)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rollout.llm.sleep(level=2)
    t1 = time.perf_counter()
    rollout.llm.wake_up(tags=["weights"])
    rollout.llm.wake_up(tags=["kv_cache"])
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(json.dumps({"measure": "sleep_wake", "sleep_level2_s": round(t1 - t0, 3), "wake_s": round(t2 - t1, 3)}),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
