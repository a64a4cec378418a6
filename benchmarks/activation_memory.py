"""What a training forward of the Qwen3-0.6B shape keeps for backward, and what one forward + backward costs,
with Hugging Face's RMSNorm and SwiGLU modules (`stock`) and with zbench's lean ones (`lean`,
`zbench.engine.fused`, on by default as `model.fused_ops`). Each variant runs in its own process.

    python benchmarks/activation_memory.py                      # CPU: bytes kept per token and layer
    python benchmarks/activation_memory.py --micro 8 --seq-len 900  # CUDA: also peak memory and time, 28 layers

Per variant one JSON line: `saved_kb_per_token_layer` (tensors autograd keeps for one decoder layer, parameters
not counted), and on CUDA `peak_gb` (peak allocated during a forward and backward of the whole model with its
LM loss over `micro` × `seq_len` tokens, above what the model and its gradients hold) and `fwd_bwd_s` (median of
`--repeats` after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch


def _model(layers: int, dtype: torch.dtype, device: str):
    from transformers import Qwen3ForCausalLM

    from zbench.models import qwen3_06b_config

    cfg = qwen3_06b_config()
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg).to(dtype)


def _saved_per_token_layer(model, tokens: int) -> float:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    p = next(model.parameters())
    hidden = torch.randn(1, tokens, model.config.hidden_size, dtype=p.dtype, device=p.device, requires_grad=True)
    rope = model.model.rotary_emb(hidden, torch.arange(tokens, device=p.device)[None])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](hidden, position_embeddings=rope, attention_mask=None)
    return sum(saved.values()) / tokens / 1024


def _measure(variant: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    from zbench.engine.fused import fuse

    on_cuda = torch.cuda.is_available()
    device = "cuda" if on_cuda else "cpu"
    model = _model(args.layers if on_cuda else 1, torch.bfloat16, device)
    if variant == "lean":
        fuse(model)
    out = {"variant": variant, "device": torch.cuda.get_device_name() if on_cuda else "cpu",
           "saved_kb_per_token_layer": round(_saved_per_token_layer(model, args.probe_tokens), 2)}
    if on_cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine's training workers run
        ids = torch.randint(0, model.config.vocab_size, (args.micro, args.seq_len), device=device)
        times = []
        for i in range(args.repeats + 1):
            model.zero_grad(set_to_none=False)
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
        out.update(layers=args.layers, micro=args.micro, seq_len=args.seq_len,
                   peak_gb=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                   fwd_bwd_s=round(statistics.median(times), 4))
    queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers on CUDA (the CPU probes one)")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=900)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probe-tokens", type=int, default=512, help="tokens of the per-layer probe")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for variant in ("stock", "lean"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(variant, args, queue))
        proc.start()
        print(json.dumps(queue.get()), flush=True)
        proc.join()


if __name__ == "__main__":
    main()
