#!/usr/bin/env python3
"""loss_torch.py - the peers of `tier-bench loss`: PyTorch eager (materialised logits +
F.cross_entropy) and torch.compile of a chunked loss, on the same shapes, timed the same way
(CUDA events, median of N after warm-up), with peak extra memory from
torch.cuda.max_memory_allocated deltas. Prints a fixed-width table and one JSON line; with
--tier FILE (the output of `tier-bench loss --json`) it also prints tier's ratios to eager and
checks the gates (fused forward+backward <= 0.9x eager time, extra memory <= 2% of eager's).

usage: python3 bench/loss_torch.py [--shape N,V,D]... [--iters N] [--chunk T] [--tier FILE]
       python3 bench/loss_torch.py --device cpu --shape 64,1000,32   (a logic check without a GPU)
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = [(8192, 256000, 2304), (16384, 151936, 2048)]
IGNORE = -100


def eager_loss(h, w, y):
    # What a Hugging Face causal LM does: bf16 logits, upcast, cross_entropy over all of them.
    logits = h @ w.t()
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE)


def chunk_grad(h, w, y, scale):
    """Loss sum and dL/dh of one chunk, computed together (gradient during the forward)."""
    logits = (h @ w.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = y != IGNORE
    safe = torch.where(valid, y, torch.zeros_like(y))
    picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    g = torch.exp(logits - lse.unsqueeze(1))
    g.scatter_add_(1, safe.unsqueeze(1), -valid.float().unsqueeze(1))
    g = g * (valid.float() * scale).unsqueeze(1)
    return loss, (g.to(h.dtype) @ w)


def chunk_loss(h, w, y):
    logits = (h @ w.t()).float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")


class ChunkedCE(torch.autograd.Function):
    """Chunked loss over tokens, each chunk's gradient made in the forward (as Liger Kernel);
    the chunk functions are compiled. lm_head frozen: no dW."""

    @staticmethod
    def forward(ctx, h, w, y, chunk, fn):
        count = (y != IGNORE).sum().clamp(min=1)
        scale = 1.0 / count.float()
        dh = torch.empty_like(h)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for i in range(0, h.shape[0], chunk):
            l, g = fn(h[i:i + chunk], w, y[i:i + chunk], scale)
            total += l
            dh[i:i + chunk] = g
        ctx.save_for_backward(dh)
        return total * scale

    @staticmethod
    def backward(ctx, dout):
        (dh,) = ctx.saved_tensors
        return dh * dout.to(dh.dtype), None, None, None, None


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters, warmup=2):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def peak_extra(device, fn):
    """Bytes allocated at the peak of fn beyond what was allocated before it (0 on the CPU)."""
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_shape(device, n, v, d, args, timer):
    gen = torch.Generator(device=device).manual_seed(1234)
    h = (torch.randn(n, d, device=device, generator=gen) * 1.0).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, d, device=device, generator=gen) / d ** 0.5).to(torch.bfloat16)  # frozen lm_head
    y = torch.randint(0, v, (n,), device=device, generator=gen)
    h.grad = torch.zeros_like(h)  # dH exists before timing, as tier's dH buffer does
    rows = []

    # eager
    state = {}

    def e_fwd():
        state["loss"] = eager_loss(h, w, y)

    def e_bwd():
        state["loss"].backward()

    def e_fwd_bwd():
        eager_loss(h, w, y).backward()

    def e_fwd_then_bwd_timed():
        e_fwd()
        return None

    fwd = timer(e_fwd, args.iters)
    bwd_times = []
    for _ in range(args.iters + 2):
        e_fwd()
        bwd_times.append(timer(e_bwd, 1, warmup=0))
    bwd = statistics.median(bwd_times[2:])
    state.clear()
    fb = timer(e_fwd_bwd, args.iters)
    mem = peak_extra(device, e_fwd_bwd)
    with torch.no_grad():
        loss = eager_loss(h, w, y).item()
    rows.append(dict(impl="eager", N=n, V=v, D=d, fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=fb, extra_bytes=mem, loss=loss))

    # torch.compile of a chunked loss (gradient made chunk by chunk during the forward)
    chunk = min(args.chunk, n)
    cg = torch.compile(chunk_grad, dynamic=False)
    cl = torch.compile(chunk_loss, dynamic=False)

    def c_fwd():
        with torch.no_grad():
            total = torch.zeros((), device=device)
            for i in range(0, n, chunk):
                total += cl(h[i:i + chunk], w, y[i:i + chunk])
            state["closs"] = total / (y != IGNORE).sum()

    def c_fwd_bwd():
        ChunkedCE.apply(h, w, y, chunk, cg).backward()

    fwd = timer(c_fwd, args.iters)
    fb = timer(c_fwd_bwd, args.iters)
    mem = peak_extra(device, c_fwd_bwd)
    with torch.no_grad():
        closs = ChunkedCE.apply(h, w, y, chunk, cg).item()
    rows.append(dict(impl="compile-chunked", N=n, V=v, D=d, fwd_ms=fwd, bwd_ms=None, fwd_bwd_ms=fb,
                     extra_bytes=mem, loss=closs, chunk=chunk))
    del h, w, y, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def fmt_ms(x):
    return "-" if x is None else f"{x:.2f}"


def fmt_bytes(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b} B"


def print_table(rows):
    cols = [("impl", "", 16), ("N", "", 7), ("V", "", 8), ("D", "", 6), ("fwd", "ms", 9), ("bwd", "ms", 9),
            ("fwd+bwd", "ms", 9), ("extra_mem", "peak", 11), ("loss", "mean", 9)]
    print("".join(f"{c[0]:>{c[2]}}" for c in cols))
    print("#" + "".join(f"{c[1]:>{c[2]}}" for c in cols)[1:])
    for r in rows:
        cells = [r["impl"], r["N"], r["V"], r["D"], fmt_ms(r["fwd_ms"]), fmt_ms(r["bwd_ms"]), fmt_ms(r["fwd_bwd_ms"]),
                 fmt_bytes(r["extra_bytes"]), f"{r['loss']:.4f}"]
        print("".join(f"{str(c):>{w[2]}}" for c, w in zip(cells, cols)))


def read_tier(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                obj = json.loads(line)
                if obj.get("bench") == "loss" and obj.get("impl") == "tier":
                    return obj
    raise SystemExit(f"loss_torch.py: no tier-bench loss JSON line in {path} (run tier-bench loss --json)")


def compare(tier, rows, time_gate, mem_gate):
    """Print tier/eager ratios per shape; returns 0 when every gate holds."""
    bad = 0
    print("# tier vs eager (gates: fwd+bwd <= %.2fx eager time, extra memory <= %.1f%% of eager's)"
          % (time_gate, mem_gate * 100))
    print(f"{'N':>7}{'V':>8}{'D':>6}{'tier_ms':>10}{'eager_ms':>10}{'time':>8}{'tier_mem':>12}{'eager_mem':>12}"
          f"{'mem':>9}{'compile_ms':>12}{'gate':>6}")
    for t in tier["results"]:
        e = next((r for r in rows if r["impl"] == "eager" and (r["N"], r["V"], r["D"]) == (t["N"], t["V"], t["D"])), None)
        c = next((r for r in rows if r["impl"] == "compile-chunked" and (r["N"], r["V"], r["D"]) == (t["N"], t["V"], t["D"])), None)
        if e is None:
            print(f"# shape {t['N']},{t['V']},{t['D']} not measured here")
            continue
        tr = t["fwd_bwd_ms"] / e["fwd_bwd_ms"]
        mr = t["extra_bytes"] / e["extra_bytes"] if e["extra_bytes"] else float("nan")
        ok = tr <= time_gate and (e["extra_bytes"] == 0 or mr <= mem_gate)
        bad += not ok
        print(f"{t['N']:>7}{t['V']:>8}{t['D']:>6}{t['fwd_bwd_ms']:>10.2f}{e['fwd_bwd_ms']:>10.2f}{tr:>7.2f}x"
              f"{fmt_bytes(t['extra_bytes']):>12}{fmt_bytes(e['extra_bytes']):>12}{mr * 100:>8.2f}%"
              f"{fmt_ms(c['fwd_bwd_ms'] if c else None):>12}{'ok' if ok else 'FAIL':>6}")
        if abs(t["loss"] - e["loss"]) > 1e-2 * abs(e["loss"]):
            print(f"# note: losses differ: tier {t['loss']:.5f}, eager {e['loss']:.5f} (inputs are drawn differently)")
    print(f"# summary: {len(tier['results'])} shapes, {bad} over a gate")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", action="append", help="N,V,D (repeatable; default the two tier-bench shapes)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the compiled loss")
    ap.add_argument("--tier", help="output of `tier-bench loss --json` to compare with")
    ap.add_argument("--time-gate", type=float, default=0.9)
    ap.add_argument("--mem-gate", type=float, default=0.02)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else DEFAULT_SHAPES
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        ap.error("--shape takes N,V,D (positive)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device; use --device cpu with small shapes")
    device = torch.device(args.device)
    timer = Timer(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# loss_torch.py: torch {torch.__version__} on {name}; median of {args.iters} runs after 2 warm-up runs;"
          f" lm_head frozen, backward to H only")
    rows = []
    for n, v, d in shapes:
        rows += bench_shape(device, n, v, d, args, timer)
    print_table(rows)
    print(json.dumps({"bench": "loss", "impl": "torch", "device": name, "torch": torch.__version__, "results": rows}))
    if args.tier:
        return compare(read_tier(args.tier), rows, args.time_gate, args.mem_gate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
