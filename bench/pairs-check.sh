#!/usr/bin/env bash
# pairs-check.sh - session 29's second GPU call: tier-bench moe without and with a form of the
# products, FORM (default TIER_MOE_WGMMA_CLUSTER=2, CTA pairs; TIER_MOE_WGMMA_EPI=tma the TMA-store
# epilogue), on qwen3-30b, and seed-896 on the 128x256 tile both ways, then test_moe_wgmma; where
# the form's gate-up beat the default on qwen3-30b, the trainer's job (a) at batch 1 under both
# (bench/forms-ab.sh, one round, H100 arguments).
# usage: bench/pairs-check.sh BIN_DIR OUT_DIR
set -u
b=$1 out=$2
mkdir -p "$out"
form=${FORM:-TIER_MOE_WGMMA_CLUSTER=2}
nvidia-smi --query-gpu=name --format=csv,noheader
t=$b/tier-bench
timeout 60 "$t" moe --model qwen3-30b > "$out/moe.log" 2>&1
env "$form" timeout 60 "$t" moe --model qwen3-30b > "$out/moe-pairs.log" 2>&1
TIER_MOE_WGMMA_TILE=128x256 timeout 60 "$t" moe --model seed-896 > "$out/seed128.log" 2>&1
TIER_MOE_WGMMA_TILE=128x256 env "$form" timeout 60 "$t" moe --model seed-896 > "$out/seed128-pairs.log" 2>&1
for f in moe moe-pairs seed128 seed128-pairs; do
	echo "== $f"; grep -E "(gate-up|gate-up-mm|down|experts-fwd|experts-bwd|block-fwd\+bwd) " "$out/$f.log"
done
timeout 150 "$b/tests/test_moe_wgmma" > "$out/wgmma.log" 2>&1; echo "wgmma rc=$?"; tail -1 "$out/wgmma.log"
us() { awk '$1 == "qwen3-30b" && $2 == "uniform" && $3 == "gate-up" { print ($5 == "ms" ? $4 * 1000 : $4) }' "$1"; }
one=$(us "$out/moe.log") two=$(us "$out/moe-pairs.log")
echo "qwen3-30b gate-up: default $one us, $form $two us"
if [ -n "$one" ] && [ -n "$two" ] && awk -v a="$one" -v b="$two" 'BEGIN { exit !(b < a) }'; then
	TESTS=" " VARIANTS=";$form" ROUNDS=1 STEPS=7 A_ARGS="--batch 1 --ddr 4G --op-cache all:hbm=48G" \
		bench/forms-ab.sh "$b" "$out/ab" 2>&1 | tail -12
fi
