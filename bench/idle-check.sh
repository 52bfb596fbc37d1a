#!/usr/bin/env bash
# idle-check.sh - the GPU call planned for the idle consumers (TIER_MOE_WGMMA_IDLE=1, off by
# default, moe_wgmma.h; written in session 30, not yet run on a GPU): test_moe_wgmma under both
# settings, then tier-bench moe on qwen3-30b and seed-896 with the default (0) and with 1, torch's
# figures against the run with 1 (bench/moe_torch.py), test_moe_cuda under 1, then, where the time
# before DEADLINE (seconds since the start) allows, the trainer's job (a) both ways
# (bench/forms-ab.sh, two rounds; batch 1 on an H100, whose 80 GB do not hold batch 3).
# usage: bench/idle-check.sh BIN_DIR OUT_DIR
set -u
b=$1 out=$2
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu"
t=test_moe_wgmma
timeout 200 "$b/tests/$t" > "$out/$t.log" 2>&1; echo "$t rc=$?"; tail -1 "$out/$t.log"
TIER_MOE_WGMMA_IDLE=1 timeout 200 "$b/tests/$t" > "$out/$t-idle.log" 2>&1; echo "$t (idle 1) rc=$?"
tail -1 "$out/$t-idle.log"
models=(--model qwen3-30b --model seed-896)
timeout 200 "$b/tier-bench" moe "${models[@]}" > "$out/moe.log" 2>&1
TIER_MOE_WGMMA_IDLE=1 timeout 200 "$b/tier-bench" moe "${models[@]}" --json > "$out/moe-idle.log" 2>&1
timeout 200 python3 bench/moe_torch.py "${models[@]}" --tier "$out/moe-idle.log" > "$out/moe-torch.log" 2>&1
rows() { grep -E " (gate-up|gate-up-mm|down|experts-fwd|experts-bwd|block-fwd\+bwd) " "$1"; }
echo "== idle 0 (default)"; rows "$out/moe.log"
echo "== idle 1"; rows "$out/moe-idle.log"
echo "== torch against idle 1"; grep -E "^ +(qwen3|seed)" "$out/moe-torch.log"
t=test_moe_cuda
TIER_MOE_WGMMA_IDLE=1 timeout 200 "$b/tests/$t" > "$out/$t.log" 2>&1; echo "$t (idle 1) rc=$?"; tail -1 "$out/$t.log"
# the trainer's A/B takes about 100 s: only where the call's limit leaves it (DEADLINE, seconds)
[ "$SECONDS" -lt "${DEADLINE:-100000}" ] || { echo "no time left for the trainer's job"; exit 0; }
case $gpu in
*H100*) export A_ARGS="--batch 1 --ddr 4G --op-cache all:hbm=48G" STEPS=7 ;;
esac
TESTS=" " VARIANTS=";TIER_MOE_WGMMA_IDLE=1" ROUNDS=2 bench/forms-ab.sh "$b" "$out/ab" 2>&1 | tail -2
