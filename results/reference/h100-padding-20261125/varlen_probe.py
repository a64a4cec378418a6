"""Packed (variable-length) attention and cuDNN's against padded SDPA (flash) at one decoder layer's attention shapes (Qwen3-0.6B:
16 query heads, 8 key/value heads, head size 128), forward and backward, on one GPU:

    python3 results/reference/h100-padding-20261125/varlen_probe.py

Rows: 32 sequences of 512 response tokens after a prompt of 100-260 tokens (GSM8K's range with the preset's
tokenizer). Prints one JSON line per kernel: median ms for forward + backward over 20 repeats, and the largest
difference of the packed output from the padded one on real tokens."""

from __future__ import annotations

import inspect
import json
import statistics
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
H, HKV, D, B = 16, 8, 128, 32
lens = (torch.randint(100, 261, (B,)) + 512).tolist()
width, total = max(lens), sum(lens)
print(json.dumps({"torch": torch.__version__, "rows": B, "tokens": total, "padded_tokens": B * width}))
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn signature:", inspect.signature(varlen_attn))
except ImportError as e:
    varlen_attn = None
    print("no varlen_attn:", e)

q = torch.randn(total, H, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)


def padded(t: torch.Tensor) -> torch.Tensor:  # [total, h, D] -> [B, h, width, D], right-padded
    out = t.new_zeros(B, t.shape[1], width, D)
    for i in range(B):
        out[i, :, : lens[i]] = t[cu[i] : cu[i + 1]].transpose(0, 1)
    return out


def unpad(t: torch.Tensor) -> torch.Tensor:  # [B, H, width, D] -> [total, H, D]
    return torch.cat([t[i, :, : lens[i]].transpose(0, 1) for i in range(B)])


qp, kp, vp = padded(q), padded(k), padded(v)


def sdpa() -> torch.Tensor:
    return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)


def sdpa_expanded() -> torch.Tensor:
    return F.scaled_dot_product_attention(qp, kp.repeat_interleave(2, 1), vp.repeat_interleave(2, 1), is_causal=True)


def _varlen(kk: torch.Tensor, vv: torch.Tensor, **kw: object) -> torch.Tensor:
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    return varlen_attn(q, kk, vv, cu, cu, width, width, **kw)


def varlen_gqa() -> torch.Tensor:
    kw = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return _varlen(k, v, **kw)


def varlen_expanded() -> torch.Tensor:
    return _varlen(k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))


def timed(fn) -> dict[str, object]:
    for t in (q, k, v, qp, kp, vp):
        t.requires_grad_(True)
    try:
        out = fn()
    except Exception as e:  # a kernel that does not take these inputs is a result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    ref = unpad(sdpa().detach()) if fn not in (sdpa, sdpa_expanded) else None
    got = out.detach() if out.dim() == 3 else unpad(out.detach())
    err = (got.float() - ref.float()).abs().max().item() if ref is not None else 0.0
    times = []
    for i in range(21):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        o = fn()
        o.backward(torch.ones_like(o))
        e.record()
        torch.cuda.synchronize()
        if i:
            times.append(s.elapsed_time(e))
    return {"fwd_bwd_ms": round(statistics.median(times), 3), "max_abs_diff": err}


from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def backend(fn, kind: SDPBackend):
    def run() -> torch.Tensor:
        with sdpa_kernel([kind]):
            return fn()
    return run


for name, fn in [("sdpa_padded_gqa", sdpa), ("sdpa_padded_expanded", sdpa_expanded),
                 ("varlen_gqa", varlen_gqa), ("varlen_expanded", varlen_expanded),
                 ("cudnn_padded_gqa", backend(sdpa, SDPBackend.CUDNN_ATTENTION)),
                 ("cudnn_padded_expanded", backend(sdpa_expanded, SDPBackend.CUDNN_ATTENTION))]:
    if name.startswith("varlen") and varlen_attn is None:
        continue
    print(json.dumps({"kernel": name, **timed(fn)}), flush=True)

# cuDNN builds an execution plan per new shape: the first call at each of 8 new widths against a repeat at one
for kind, label in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
    first, again = [], []
    for w in range(width + 8, width + 72, 8):
        qq = torch.randn(B, H, w, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kk = torch.randn(B, H, w, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for store in (first, again):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel([kind]):
                o = F.scaled_dot_product_attention(qq, kk, kk, is_causal=True)
            o.sum().backward()
            torch.cuda.synchronize()
            store.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"kernel": f"{label}_new_widths", "first_call_ms_median": round(statistics.median(first), 2),
                      "repeat_ms_median": round(statistics.median(again), 2)}), flush=True)
