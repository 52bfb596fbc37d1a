#!/usr/bin/env python3
"""kprof_trace.py - one training step of a kprof timeline (TIER_KPROF_TRACE, tools/kprof.c): how
busy the device was, its longest idle gaps with the kernels on either side and what the host was
calling meanwhile, the idle time by the kernel that ended each gap and by the one before it, and
the device and host time by name. Traces with CUPTI's correlation ids (tools/kprof.c writes them
since session 18: a device record and the runtime call that launched it share one) also say which
gaps the host caused: those whose next record was launched only inside the gap, with the host's
own time before that launch (since its thread's runtime call before it returned) summed by that
call's name (after cudaStreamSynchronize or a device-to-host copy: the host waited for the device,
then worked before launching again).

Steps are found by the embedding kernel, which runs once at the start of each step's forward.

usage: bench/kprof_trace.py TRACE[.gz] [--step N (default: the last whole one)] [--gaps 25] [--seq FILE]
"""
import argparse
import bisect
import collections
import gzip
import re
import subprocess
import sys


def read(path):
    """Device records and host runtime calls (start, end, name, correlation id or None, stream or
    thread), by start. Lines: K|C|M|R start end where [corr] name (corr since session 18)."""
    dev, host = [], []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        for line in f:
            p = line.rstrip("\n").split(" ", 5)
            if len(p) < 5 or p[0] not in ("K", "C", "M", "R"):
                continue
            if len(p) == 6 and p[4].isdigit():
                rec = (int(p[1]), int(p[2]), p[5], int(p[4]), int(p[3]))
            else: # no correlation id: the name is the rest of the line
                rec = (int(p[1]), int(p[2]), " ".join(p[4:]), None, int(p[3]))
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
    starts = [r[0] for r in dev if "embed_kernel" in r[2]]
    wins = [(a, b) for a, b in zip(starts, starts[1:])]
    if starts:
        wins.append((starts[-1], max(r[1] for r in dev)))
    return wins


def by_name(pairs, top):
    """(name, count, total) of (name, amount) pairs, largest total first, the first top."""
    tot = collections.defaultdict(lambda: [0, 0])
    for n, t in pairs:
        tot[n][0] += 1
        tot[n][1] += t
    return [(n, c, t) for n, (c, t) in sorted(tot.items(), key=lambda x: -x[1][1])[:top]]


def late_gaps(gaps, host, top):
    """The gaps whose next record the host launched inside the gap (by correlation id), and the
    host's time before each such launch by the runtime call that preceded it on its thread."""
    by_corr = {r[3]: r for r in host if r[3] is not None}
    if not by_corr:
        print("\n# (no correlation ids in this trace: which gaps the host caused is not known)")
        return
    threads = collections.defaultdict(list)
    for r in host:
        threads[r[4]].append(r)
    tstarts = {t: [r[0] for r in v] for t, v in threads.items()}
    n, ns, before = 0, 0, collections.Counter()
    for dur, gs, ge, _, after in gaps:
        call = by_corr.get(after[3])
        if call is None or call[0] < gs:
            continue # launched before the gap began: the device waited on something else
        n, ns = n + 1, ns + dur
        i = bisect.bisect_left(tstarts[call[4]], call[0]) - 1
        if i >= 0:
            prior = threads[call[4]][i]
            before[prior[2]] += max(0, call[0] - prior[1])
    print(f"\n# gaps whose next record the host launched inside the gap: {n} of {len(gaps)}, {ns / 1e6:.3f} ms; "
          "the host's time before those launches, by the runtime call before each: ms, name")
    for name, t in before.most_common(top):
        print(f"{t / 1e6:9.3f}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, default=0, help="1-based step (0: the last whole one)")
    ap.add_argument("--gaps", type=int, default=25)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--seq", metavar="FILE", help="also write the step's device records in order "
                    "(start us from the step's start, us, name) to FILE: which product is which kernel")
    a = ap.parse_args()
    dev, host = read(a.trace)
    wins = step_windows(dev)
    if not wins:
        sys.exit("kprof_trace: no embed_kernel in the trace: no step to cut out")
    k = a.step - 1 if a.step else max(0, len(wins) - 2)  # the last window may hold the run's tail
    lo, hi = wins[k]
    d = [r for r in dev if lo <= r[0] < hi]
    h = [r for r in host if lo <= r[0] < hi]
    short = demangler([r[2] for r in d])
    span = max(r[1] for r in d) - lo
    if a.seq:
        with open(a.seq, "w") as f:
            for r in d:
                f.write(f"{(r[0] - lo) / 1e3:10.1f} {(r[1] - r[0]) / 1e3:8.1f}  {short.get(r[2], r[2])}\n")
    # union of the device spans, and its gaps (length, start, end, name before, record after)
    busy, gaps, cur_s, cur_e, prev = 0, [], None, None, None
    for r in d:
        s, e, n = r[0], r[1], r[2]
        if cur_e is None:
            cur_s, cur_e, prev = s, e, n
            continue
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, s, prev, r))
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
    for g in sorted(gaps, key=lambda g: g[0], reverse=True)[:a.gaps]:
        dur, gs, ge, before, after = g
        i = bisect.bisect_left(hstarts, gs - 50_000_000)
        calls = collections.Counter()
        for s, e, n, *_ in h[i:]:
            if s >= ge:
                break
            if e > gs:
                calls[n] += min(e, ge) - max(s, gs)
        what = ", ".join(f"{n} {t / 1e3:.0f}" for n, t in calls.most_common(3))
        print(f"{dur / 1e3:9.1f}  {short.get(before, before)} -> {short.get(after[2], after[2])}  [{what}]")
    for title, key in (("kernel after the gap", lambda g: g[4][2]), ("kernel before the gap", lambda g: g[3])):
        print(f"\n# idle by the {title}: ms, gaps, mean us, name")
        for n, c, t in by_name(((key(g), g[0]) for g in gaps), a.top):
            print(f"{t / 1e6:9.3f} {c:7d} {t / 1e3 / c:8.2f}  {short.get(n, n)}")
    late_gaps(gaps, host, a.top)
    for title, recs, names in (("device", d, short), ("host runtime calls", h, {})):
        print(f"\n# {title} by name: ms, calls, name")
        for n, c, t in by_name(((r[2], r[1] - r[0]) for r in recs), a.top):
            print(f"{t / 1e6:9.3f} {c:7d}  {names.get(n, n)}")


if __name__ == "__main__":
    main()
