#!/usr/bin/env python3
"""kprof_gaps.py - where a profiled run's device sat idle, from a TIER_KPROF_TRACE timeline.

tools/kprof.c with TIER_KPROF_TRACE=FILE writes one line per record:
    K|C|M|R start_ns end_ns stream_or_thread correlation_id name
(K kernel, C copy, M memset: the device; R a runtime API call on the host; a device record and
the call that launched it share the correlation id). This reads such a
file, keeps the device records of a window (the last --last-ms, or everything after the end of the
--after kernel's --skip-th call: e.g. --after adamw_many --skip 1 starts after step 1's optimizer),
and lists the idle gaps between the union of the device's records:
  - totals by length;
  - the gaps' time by the kernel that ended the gap (the one the device waited for) and by the one
    before it;
  - for each gap, whether the host launched the record after it late: when the runtime call
    that launched it (by correlation id) began inside the gap, the device waited for the host; the
    host's own time before that call (since its thread's runtime call before it ended) is what it
    was doing meanwhile, summed by that earlier call's name (after cudaStreamSynchronize or a
    device-to-host cudaMemcpy: the host waited for the device, then worked before launching again).

Usage: bench/kprof_gaps.py TRACE [--last-ms N | --after NAME --skip K] [--min-us 2] [--top 20]
Names are demangled with c++filt when it is installed. Reference tooling, not part of tier.
"""
import argparse
import bisect
import collections
import shutil
import subprocess
import sys


def read_trace(path):
    dev, host = [], []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            p = line.rstrip("\n").split(" ", 5)
            if len(p) < 6 or p[0] not in "KCMR" or not all(x.isdigit() for x in p[1:5]):
                sys.exit(f"kprof_gaps: {path}:{n}: not a kprof trace line (K|C|M|R start end where corr "
                         f"name): {line.strip()[:80]!r}")
            # (start, end, name, correlation id, thread)
            rec = (int(p[1]), max(int(p[1]), int(p[2])), p[5], int(p[4]), int(p[3]))
            (host if p[0] == "R" else dev).append(rec)
    dev.sort()
    host.sort()
    return dev, host


def demangler(names):
    names = sorted(set(names))
    if not shutil.which("c++filt") or not names:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: (out[i] if i < len(out) and out[i] else n) for i, n in enumerate(names)}


def window(dev, args):
    if args.last_ms is not None:
        end = max(r[1] for r in dev)
        return end - int(args.last_ms * 1e6)
    if args.after:
        hits = [r for r in dev if args.after in r[2]]
        if len(hits) < args.skip:
            sys.exit(f"kprof_gaps: only {len(hits)} records match --after {args.after!r}, --skip {args.skip} asked")
        return hits[args.skip - 1][1] if args.skip else 0
    return 0


def gaps_of(dev, t0, min_ns):
    """(gap start, gap end, record before, record after) for the window's idle stretches."""
    out, cur_end, prev = [], None, None
    for r in dev:
        if r[0] < t0 or r[1] == r[0]:
            continue
        if cur_end is not None and r[0] > cur_end:
            if r[0] - cur_end >= min_ns:
                out.append((cur_end, r[0], prev, r))
        if cur_end is None or r[1] > cur_end:
            cur_end, prev = r[1], r
    return out, cur_end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--last-ms", type=float)
    ap.add_argument("--after")
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("--min-us", type=float, default=2.0)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    dev, host = read_trace(a.trace)
    if not dev:
        sys.exit("kprof_gaps: no device records in the trace")
    t0 = window(dev, a)
    gaps, end = gaps_of(dev, t0, int(a.min_us * 1000))
    first = next(r[0] for r in dev if r[0] >= t0)
    span = end - first
    busy = span - sum(g[1] - g[0] for g in gaps)
    dm = demangler([g[2][2] for g in gaps] + [g[3][2] for g in gaps])
    short = lambda n: dm.get(n, n)[:90]
    idle = span - busy
    print(f"# window {span / 1e6:.3f} ms from {first}; idle in gaps >= {a.min_us} us: {idle / 1e6:.3f} ms "
          f"({100 * idle / max(span, 1):.1f}%) in {len(gaps)} gaps")
    bins = collections.Counter()
    for g in gaps:
        us = (g[1] - g[0]) / 1e3
        bins["<10us" if us < 10 else "<100us" if us < 100 else "<1ms" if us < 1000 else ">=1ms"] += g[1] - g[0]
    print("# by length: " + ", ".join(f"{k} {v / 1e6:.3f} ms" for k, v in sorted(bins.items())))
    for title, key in (("kernel after the gap", 3), ("kernel before the gap", 2)):
        c, n = collections.Counter(), collections.Counter()
        for g in gaps:
            c[short(g[key][2])] += g[1] - g[0]
            n[short(g[key][2])] += 1
        print(f"\n# idle by the {title}: ms, gaps, mean us")
        for name, ns in c.most_common(a.top):
            print(f"{ns / 1e6:9.3f} {n[name]:7d} {ns / 1e3 / n[name]:8.2f}  {name}")
    by_corr = {h[3]: h for h in host}
    by_thread = collections.defaultdict(list)
    for h in host:
        by_thread[h[4]].append(h)
    starts = {t: [h[0] for h in v] for t, v in by_thread.items()}
    late, late_ns, before = 0, 0, collections.Counter()
    for g in gaps:
        call = by_corr.get(g[3][3])
        if call is None or call[0] < g[0]:
            continue # launched before the gap began (or unknown): the device waited on something else
        late += 1
        late_ns += g[1] - g[0]
        v = by_thread[call[4]]
        i = bisect.bisect_left(starts[call[4]], call[0]) - 1 # the thread's call before the launch
        if i >= 0:
            before[v[i][2]] += max(0, call[0] - v[i][1])
    print(f"\n# gaps whose next record the host launched inside the gap: {late} of {len(gaps)}, "
          f"{late_ns / 1e6:.3f} ms; the host's time before that launch, by the runtime call before it:")
    for name, ns in before.most_common(a.top):
        print(f"{ns / 1e6:9.3f}  {name}")
    if not host:
        print("# (the trace has no host records: kprof writes them only with TIER_KPROF_TRACE)")


if __name__ == "__main__":
    main()
