#!/usr/bin/env python3
"""attn_torch.py - the peer of `tier-bench attn`: torch's F.scaled_dot_product_attention
(is_causal=True, enable_gqa=True, bf16; PyTorch picks its fastest backend, flash or cuDNN) on the
same shapes, timed the same way (CUDA events, median of N after two warm-ups): forward, backward
alone (autograd from a saved forward) and forward+backward. Prints a fixed-width table and one
JSON line; with --tier FILE (the output of `tier-bench attn --json`) it also prints tier's time
ratios (tier / torch: below 1 means tier is faster).

usage: python3 bench/attn_torch.py [--shape B,S,H,KVH,D]... [--iters N] [--tier FILE]
       python3 bench/attn_torch.py --device cpu --shape 1,64,4,2,32 --iters 2  (a logic check)
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = [(1, 4096, 32, 4, 128)]
OPS = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def fwd_flop(b, s, h, d):
    # Causal: two products (QK^T, PV) of 2*S*S*D per head, half of them under the mask.
    return 4.0 * s * s * d * h * b / 2.0


def timed(fn, dev, iters):
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if dev == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_shape(shape, dev, iters):
    b, s, h, kh, d = shape
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    # [B, heads, S, D], as SDPA wants; the same data as tier's [T, heads, D] layout, transposed.
    q = (torch.rand(b, h, s, d, device=dev, dtype=dtype) * 3.4 - 1.7).requires_grad_()
    k = (torch.rand(b, kh, s, d, device=dev, dtype=dtype) * 3.4 - 1.7).requires_grad_()
    v = (torch.rand(b, kh, s, d, device=dev, dtype=dtype) * 3.4 - 1.7).requires_grad_()
    do = torch.rand(b, h, s, d, device=dev, dtype=dtype) * 3.4 - 1.7

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)

    saved = {}

    def bwd():
        o = saved["o"]
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    ms = {"fwd": timed(fwd, dev, iters), "fwd+bwd": timed(fwd_bwd, dev, iters)}
    saved["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ms["bwd"] = timed(bwd, dev, iters)
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", default=[], help="B,S,H,KVH,D (repeatable)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tier", help="file holding `tier-bench attn --json` output")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in a.shape] or DEFAULT_SHAPES
    if any(len(sh) != 5 or min(sh) < 1 for sh in shapes):
        sys.exit("attn_torch.py: --shape takes B,S,H,KVH,D, all positive")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("attn_torch.py: no CUDA device (use --device cpu for a logic check)")
    tier = {}
    if a.tier:
        for line in open(a.tier):
            if line.startswith("{"):
                for r in json.loads(line)["results"]:
                    tier[(r["B"], r["S"], r["H"], r["KVH"], r["D"])] = r
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# attn_torch.py: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), "
          f"{'bf16' if a.device == 'cuda' else 'fp32'}, torch {torch.__version__}, device {name}")
    print(f"# median of {a.iters} runs after 2 warm-up runs (CUDA events); ratio = tier time / torch time")
    print(f"# rate counts causal FLOPs: fwd 4*S*S*D*H*B/2, bwd 2.5x that, fwd+bwd 3.5x")
    hdr = f"{'B':>4} {'S':>7} {'H':>4} {'KVH':>4} {'D':>4} {'op':>8} {'torch':>10} {'rate':>9} {'tier':>10} {'rate':>9} {'ratio':>7}"
    print(hdr)
    print(f"{'':>4} {'':>7} {'':>4} {'':>4} {'':>4} {'':>8} {'ms':>10} {'TFLOP/s':>9} {'ms':>10} {'TFLOP/s':>9} {'x':>7}")
    out = []
    for sh in shapes:
        ms = bench_shape(sh, a.device, a.iters)
        b, s, h, kh, d = sh
        t = tier.get(sh)
        for op in OPS:
            flop = FLOP_FACTOR[op] * fwd_flop(b, s, h, d)
            tier_ms = t[{"fwd": "fwd_ms", "bwd": "bwd_ms", "fwd+bwd": "fwd_bwd_ms"}[op]] if t else None
            cells = f"{b:>4} {s:>7} {h:>4} {kh:>4} {d:>4} {op:>8} {ms[op]:>10.3f} {flop / ms[op] / 1e9:>9.1f}"
            if tier_ms:
                cells += f" {tier_ms:>10.3f} {flop / tier_ms / 1e9:>9.1f} {tier_ms / ms[op]:>7.2f}"
            else:
                cells += f" {'-':>10} {'-':>9} {'-':>7}"
            print(cells)
        out.append({"B": b, "S": s, "H": h, "KVH": kh, "D": d, "fwd_ms": ms["fwd"], "bwd_ms": ms["bwd"],
                    "fwd_bwd_ms": ms["fwd+bwd"]})
    print(json.dumps({"bench": "attn", "impl": "torch_sdpa", "device": name, "results": out}))


if __name__ == "__main__":
    main()
