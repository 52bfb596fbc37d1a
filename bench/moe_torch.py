#!/usr/bin/env python3
"""moe_torch.py - the peer of `tier-bench moe`: torch._grouped_mm for the experts' gate_up and down
products, and a torchtitan-style MoE block built on it (softmax router in fp32, top-k,
renormalised weights, stable sort by expert, groups padded to 16 rows as torchtitan's
generate_permute_indices does, gather, grouped gate_up, SiLU-gate, grouped down, weighted
index_add back to tokens), on the same shapes and the same routing (uniform, or Zipf s=1.2 over the
experts without replacement, imposed through the router's input exactly as tier-bench moe does),
timed the same way (CUDA events, median of N after two warm-ups). Forward+backward takes the input
gradient only (frozen router and experts, as tier's bench). Prints a fixed-width table and one JSON
line; with --tier FILE (the output of `tier-bench moe --json`) it also prints the speedups
torch time / tier time (above 1: tier is faster), the form of the issue's targets.

usage: python3 bench/moe_torch.py [--model NAME]... [--shape T,H,I,E,k]... [--routing R] [--iters N] [--warmup-ms N]
                                  [--tier FILE]
       python3 bench/moe_torch.py --device cpu --shape 64,48,40,8,2 --iters 2   (a logic check)
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MODELS = {
    "qwen3-30b": (16384, 2048, 768, 128, 8),
    "seed-896": (8192, 2048, 512, 896, 16),
    "mixtral": (8192, 4096, 14336, 8, 2),
}
ALIGN = 16  # torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for the grouped GEMM
OPS = ("gate_up", "down", "experts_fwd", "permute", "block_fwd", "block_fwd_bwd")


def timed(fn, dev, iters, warm_ms):
    """Median ms of iters runs, after untimed runs adding up to warm_ms (at least 2): the GPU's clocks
    settle to what a long job sees (tier-bench moe --warmup-ms does the same)."""
    spent, n = 0.0, 0
    while n < 2 or (spent < warm_ms and n < 10000):
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        spent += (time.perf_counter() - t0) * 1e3
        n += 1
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


def make_inputs(T, H, I, E, k, zipf, dev, dtype):
    """x with the sampled routing in its first E columns and W_r ~ identity there (tier's scheme)."""
    gen = torch.Generator().manual_seed(1234 + zipf)
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2 if zipf else torch.ones(E, dtype=torch.float64)
    sel = torch.multinomial(p.float().expand(T, E), k, replacement=False, generator=gen)
    x = torch.rand(T, H, generator=gen) * 2 - 1
    x[:, :E] *= 0.3
    x.scatter_(1, sel, (3.0 + 0.1 * (k - torch.arange(k, dtype=torch.float32))).expand(T, k).contiguous())
    w_r = torch.eye(E, H) + (torch.rand(E, H, generator=gen) * 2 - 1) * 1e-3
    g = torch.Generator(device=dev).manual_seed(99)
    # HF layouts: fused gate_up [E, 2I, H] (gate rows first), down [E, H, I]
    w_gu = (torch.rand(E, 2 * I, H, device=dev, dtype=dtype, generator=g) * 2 - 1) / math.sqrt(H)
    w_d = (torch.rand(E, H, I, device=dev, dtype=dtype, generator=g) * 2 - 1) / math.sqrt(I)
    return x.to(dev, dtype), w_r.to(dev, dtype), w_gu, w_d, sel


def route(x, w_r, k):
    logits = (x @ w_r.t()).float()
    tw, ti = logits.softmax(-1).topk(k, dim=-1)
    return tw / tw.sum(-1, keepdim=True), ti


def permute_indices(ti, E, T):
    """Stable sort by expert with groups padded to ALIGN rows (a fixed-size buffer: no host sync)."""
    k = ti.shape[1]
    n = ti.numel()
    flat = ti.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    start = counts.cumsum(0) - counts
    pstart = padded.cumsum(0) - padded
    e_sorted = flat[order]
    dest = pstart[e_sorted] + (torch.arange(n, device=ti.device) - start[e_sorted])
    tok = order // k
    gidx = torch.full((n + E * ALIGN,), T, dtype=torch.long, device=ti.device)  # T: the zero row
    gidx[dest] = tok
    return order, tok, dest, gidx, padded.cumsum(0).to(torch.int32)


def experts(xg, w_gu, w_d, offs):
    h = torch._grouped_mm(xg, w_gu.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(g) * u, w_d.transpose(-2, -1), offs=offs)


def moe_block(x, w_r, w_gu, w_d, E, k):
    T, H = x.shape
    tw, ti = route(x, w_r, k)
    order, tok, dest, gidx, offs = permute_indices(ti, E, T)
    xg = torch.cat([x, x.new_zeros(1, H)])[gidx]
    y = experts(xg, w_gu, w_d, offs)
    ys = y[dest] * tw.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros(T, H, device=x.device, dtype=y.dtype).index_add_(0, tok, ys)


def bench_shape(shape, zipf, dev, iters, warm_ms):
    T, H, I, E, k = shape
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x, w_r, w_gu, w_d, sel = make_inputs(T, H, I, E, k, zipf, dev, dtype)
    n = T * k
    with torch.no_grad():
        tw, ti = route(x, w_r, k)
        missed = int((ti.unsqueeze(2) != sel.to(dev).unsqueeze(1)).all(2).sum())
        order, tok, dest, gidx, offs = permute_indices(ti, E, T)
        xp = torch.cat([x, x.new_zeros(1, H)])
        xg = xp[gidx]
        h = torch._grouped_mm(xg, w_gu.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        counts = torch.bincount(ti.reshape(-1), minlength=E).float()
        skew = float(counts.max() / counts.mean())
    dout = torch.rand(T, H, device=dev, dtype=dtype) - 0.5

    def gate_up():
        with torch.no_grad():
            return torch._grouped_mm(xg, w_gu.transpose(-2, -1), offs=offs)

    def down():
        with torch.no_grad():
            return torch._grouped_mm(a, w_d.transpose(-2, -1), offs=offs)

    def experts_fwd():
        with torch.no_grad():
            return experts(xg, w_gu, w_d, offs)

    def permute():
        with torch.no_grad():
            return xp[gidx]

    def block_fwd():
        with torch.no_grad():
            return moe_block(x, w_r, w_gu, w_d, E, k)

    xr = x.detach().clone().requires_grad_()

    def block_fwd_bwd():
        out = moe_block(xr, w_r, w_gu, w_d, E, k)
        torch.autograd.grad(out, xr, dout)

    fns = {"gate_up": gate_up, "down": down, "experts_fwd": experts_fwd, "permute": permute,
           "block_fwd": block_fwd, "block_fwd_bwd": block_fwd_bwd}
    ms = {op: timed(fns[op], dev, iters, warm_ms) for op in OPS}
    flop = {"gate_up": 4.0 * n * H * I, "down": 2.0 * n * H * I, "experts_fwd": 6.0 * n * H * I,
            "block_fwd": 6.0 * n * H * I + 2.0 * T * E * H, "block_fwd_bwd": 12.0 * n * H * I + 4.0 * T * E * H}
    gbytes = {"permute": 2.0 * n * H * x.element_size()}
    return ms, flop, gbytes, skew, missed


TIER_KEYS = {"gate_up": "gate_up_ms", "down": "down_ms", "experts_fwd": "experts_fwd_ms", "permute": "permute_ms",
             "block_fwd": "block_fwd_ms", "block_fwd_bwd": "block_fwd_bwd_ms"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], choices=sorted(MODELS), help="a model shape (repeatable)")
    ap.add_argument("--shape", action="append", default=[], help="T,H,I,E,k (repeatable)")
    ap.add_argument("--routing", default="both", choices=["uniform", "zipf", "both"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup-ms", type=float, default=200.0, help="untimed runs first, this many ms (at least 2 runs)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tier", help="file holding `tier-bench moe --json` output")
    a = ap.parse_args()
    shapes = [(m, MODELS[m]) for m in a.model]
    for sh in a.shape:
        v = tuple(int(x) for x in sh.split(","))
        if len(v) != 5 or min(v) < 1 or v[4] > v[3] or v[3] > v[1]:
            sys.exit("moe_torch.py: --shape takes T,H,I,E,k, all positive, k <= E <= H")
        shapes.append(("custom", v))
    if not shapes:
        shapes = list(MODELS.items())
    if a.iters < 1:
        sys.exit("moe_torch.py: --iters must be at least 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("moe_torch.py: no CUDA device (use --device cpu for a logic check)")
    routings = {"uniform": [0], "zipf": [1], "both": [0, 1]}[a.routing]
    tier = {}
    if a.tier:
        for line in open(a.tier):
            if line.startswith("{"):
                for r in json.loads(line)["results"]:
                    tier[(r["T"], r["H"], r["I"], r["E"], r["k"], r["routing"])] = r
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# moe_torch.py: torch._grouped_mm and a torchtitan-style MoE block, "
          f"{'bf16' if a.device == 'cuda' else 'fp32'}, torch {torch.__version__}, device {name}")
    print(f"# median of {a.iters} runs after {a.warmup_ms:g} ms of warm-up runs (at least 2; CUDA events); "
          "speedup = torch time / tier time")
    print("# FLOPs: gate_up 4nHI, down 2nHI (n = T k rows, unpadded); block adds the router 2TEH; "
          "fwd+bwd twice fwd (input gradient only)")
    print(f"{'model':>10} {'routing':>8} {'op':>14} {'torch':>10} {'rate':>9} {'unit':>8} {'tier':>10} {'rate':>9} "
          f"{'speedup':>8} {'max/mean':>9}")
    out = []
    for mname, sh in shapes:
        T, H, I, E, k = sh
        for z in routings:
            rname = "zipf" if z else "uniform"
            ms, flop, gbytes, skew, missed = bench_shape(sh, z, a.device, a.iters, a.warmup_ms)
            if missed:
                print(f"# {mname} {rname}: the router picked {missed} experts outside the sampled routing")
            t = tier.get((T, H, I, E, k, rname))
            for op in OPS:
                w = flop.get(op, gbytes.get(op, 0.0))
                unit = "TFLOP/s" if op in flop else "GB/s"
                rate = w / ms[op] / (1e9 if op in flop else 1e6)
                cells = f"{mname:>10} {rname:>8} {op:>14} {ms[op]:>10.3f} {rate:>9.1f} {unit:>8}"
                tier_ms = t.get(TIER_KEYS[op]) if t and op in TIER_KEYS else None
                if tier_ms:
                    trate = w / tier_ms / (1e9 if op in flop else 1e6)
                    cells += f" {tier_ms:>10.3f} {trate:>9.1f} {ms[op] / tier_ms:>8.2f}"
                else:
                    cells += f" {'-':>10} {'-':>9} {'-':>8}"
                print(cells + f" {skew:>9.2f}")
                floor = t.get(f"{op}_floor_ms") if t else None
                if floor:  # tier-bench moe's floor of the product: no kernel goes much below it
                    print(f"# {mname} {rname} {op}: tier's floor {floor:.3f} ms (HBM bytes at the copy's rate, or"
                          f" a dense GEMM of the FLOPs); torch / floor {ms[op] / floor:.2f}, the most a kernel doing"
                          f" tier's work could gain on torch here; tier at {floor / tier_ms:.0%} of the floor's speed")
                mm_ms = t.get("gate_up_mm_ms") if t and op == "gate_up" else None
                if mm_ms:  # tier's plain product: the same output as torch's, no SwiGLU, no h
                    print(f"{mname:>10} {rname:>8} {'gate_up(mm)':>14} {ms[op]:>10.3f} {rate:>9.1f} {unit:>8}"
                          f" {mm_ms:>10.3f} {w / mm_ms / 1e9:>9.1f} {ms[op] / mm_ms:>8.2f} {skew:>9.2f}")
                g_ms = t.get(TIER_KEYS[op].replace("_ms", "_grouped_ms")) if t and op in TIER_KEYS else None
                if g_ms:  # tier's experimental device-side grouped GEMM, against the same torch time
                    trate = w / g_ms / (1e9 if op in flop else 1e6)
                    print(f"{mname:>10} {rname:>8} {op + '-g':>14} {ms[op]:>10.3f} {rate:>9.1f} {unit:>8}"
                          f" {g_ms:>10.3f} {trate:>9.1f} {ms[op] / g_ms:>8.2f} {skew:>9.2f}")
            r = {"model": mname, "routing": rname, "T": T, "H": H, "I": I, "E": E, "k": k, "max_over_mean": skew}
            r.update({f"{op}_ms": ms[op] for op in OPS})
            out.append(r)
    print(json.dumps({"bench": "moe", "impl": "torch_grouped_mm", "device": name, "results": out}))


if __name__ == "__main__":
    main()
