#!/usr/bin/env python3
"""kprof_trace.py - one training step of a kprof timeline (TIER_KPROF_TRACE, tools/kprof.c): how
busy the device was, its longest idle gaps with the kernels on either side and what the host was
calling meanwhile, and the device and host time by name.

Steps are found by the embedding kernel, which runs once at the start of each step's forward.

usage: bench/kprof_trace.py TRACE[.gz] [--step N (default: the last whole one)] [--gaps 25]
"""
import argparse
import bisect
import collections
import gzip
import re
import subprocess
import sys


def read(path):
    """Device records (start, end, name) and host runtime calls (start, end, name), by start."""
    dev, host = [], []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            p = line.rstrip("\n").split(" ", 4)
            if len(p) < 5:
                continue
            rec = (int(p[1]), int(p[2]), p[4])
            (host if p[0] == "R" else dev).append(rec)
    dev.sort()
    host.sort()
    return dev, host


def demangler(names):
    """Short demangled names (arguments dropped) through c++filt where it exists."""
    names = sorted(set(names))
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = names
    short = {}
    for n, d in zip(names, out):
        d = re.sub(r"\(anonymous namespace\)::", "", d)
        short[n] = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", d)[:70]
    return short


def step_windows(dev):
    starts = [s for s, e, n in dev if "embed_kernel" in n]
    wins = [(a, b) for a, b in zip(starts, starts[1:])]
    if starts:
        wins.append((starts[-1], max(e for s, e, n in dev)))
    return wins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, default=0, help="1-based step (0: the last whole one)")
    ap.add_argument("--gaps", type=int, default=25)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    dev, host = read(a.trace)
    wins = step_windows(dev)
    if not wins:
        sys.exit("kprof_trace: no embed_kernel in the trace: no step to cut out")
    k = a.step - 1 if a.step else max(0, len(wins) - 2)  # the last window may hold the run's tail
    lo, hi = wins[k]
    d = [r for r in dev if lo <= r[0] < hi]
    h = [r for r in host if lo <= r[0] < hi]
    short = demangler([n for _, _, n in d])
    span = max(e for _, e, _ in d) - lo
    # union of the device spans, and its gaps
    busy, gaps, cur_s, cur_e, prev = 0, [], None, None, None
    for s, e, n in d:
        if cur_e is None:
            cur_s, cur_e, prev = s, e, n
            continue
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, s, prev, n))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        if e >= cur_e:
            prev = n
    busy += cur_e - cur_s
    print(f"# step {k + 1} of {len(wins)}: {span / 1e6:.3f} ms, device busy {busy / 1e6:.3f} ms "
          f"({100 * busy / span:.1f}%), idle {(span - busy) / 1e6:.3f} ms in {len(gaps)} gaps")
    bins = [(10e3, "<10us"), (100e3, "<100us"), (1e6, "<1ms"), (10e6, "<10ms"), (float("inf"), ">=10ms")]
    hist = collections.OrderedDict((b[1], [0, 0]) for b in bins)
    for g in gaps:
        lab = next(l for lim, l in bins if g[0] < lim)
        hist[lab][0] += 1
        hist[lab][1] += g[0]
    print("# idle gaps: " + ", ".join(f"{l} {c} ({t / 1e6:.3f} ms)" for l, (c, t) in hist.items()))
    hstarts = [r[0] for r in h]
    print(f"\n# the {a.gaps} longest gaps: us, kernel before -> kernel after; host calls running in the gap")
    for g in sorted(gaps, reverse=True)[:a.gaps]:
        dur, gs, ge, before, after = g
        i = bisect.bisect_left(hstarts, gs - 50_000_000)
        calls = collections.Counter()
        for s, e, n in h[i:]:
            if s >= ge:
                break
            if e > gs:
                calls[n] += min(e, ge) - max(s, gs)
        what = ", ".join(f"{n} {t / 1e3:.0f}" for n, t in calls.most_common(3))
        print(f"{dur / 1e3:9.1f}  {short.get(before, before)} -> {short.get(after, after)}  [{what}]")
    for title, recs, names in (("device", d, short), ("host runtime calls", h, {})):
        tot = collections.defaultdict(lambda: [0, 0])
        for s, e, n in recs:
            tot[n][0] += 1
            tot[n][1] += e - s
        print(f"\n# {title} by name: ms, calls, name")
        for n, (c, t) in sorted(tot.items(), key=lambda x: -x[1][1])[:a.top]:
            print(f"{t / 1e6:9.3f} {c:7d}  {names.get(n, n)}")


if __name__ == "__main__":
    main()
