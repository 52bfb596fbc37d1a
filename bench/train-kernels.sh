#!/usr/bin/env bash
# train-kernels.sh - where the trainer's GPU time goes, kernel by kernel: Nsight Compute's
# duration of every kernel of one training step of a 2-layer model with Qwen3-30B-A3B's layer
# shapes (bench/configs/qwen3-30b-a3b-2l.json; LoRA r 16 on q,k,v,o and experts, seq 4096), the
# step STEP alone (TIER_PROFILE_STEP: tier-run brackets it with cudaProfilerStart/Stop). The
# per-layer costs carry over to the 48-layer model; the head (loss, embedding) weighs 24x more
# here. usage: bench/train-kernels.sh BUILD_DIR OUT_DIR [STEP]   (default 3)
set -u
b=${1:?build dir}; out=${2:?out dir}; pstep=${3:-3}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
TIER_PROFILE_STEP=$pstep step 400 ncu ncu --csv --metrics gpu__time_duration.sum --profile-from-start off \
	"$b/tier-run" "${job_args[@]}" --config bench/configs/qwen3-30b-a3b-2l.json --batch 1 --steps 4 --ddr 4G
# total time per kernel name over the profiled launches, largest first
python3 - "$out/ncu.log" > "$out/kernels.txt" <<'PY'
import csv, sys, collections
tot, calls = collections.Counter(), collections.Counter()
rows = [l for l in open(sys.argv[1], errors="replace") if l.startswith('"')]
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0, "ms": 1e3}.get(r["Metric Unit"], 1.0)
    n = r["Kernel Name"][:140]
    tot[n] += v; calls[n] += 1
s = sum(tot.values()) or 1
for n, t in tot.most_common(60):
    print(f"{t:12.1f} us {100*t/s:5.1f}% {calls[n]:6d}  {n}")
print(f"total {s:.1f} us over {sum(calls.values())} launches")
PY
head -70 "$out/kernels.txt"
