#!/usr/bin/env bash
# pairs-session.sh - session 29's first GPU call: the CTA-pair products (TIER_MOE_WGMMA_CLUSTER=2)
# against the one-CTA ones in the same run. test_moe_wgmma (which runs the pairs against the fp64
# reference), then tier-bench moe on qwen3-30b and seed-896 without and with pairs, seed-896 on the
# 128x256 tile (the pairs' shape) both ways, then torch's peer (bench/moe_torch.py) on the same shapes.
# test_moe_cuda runs under TIER_MOE_WGMMA_CLUSTER=2 too (the block's products with LoRA segments).
# The steps run in order of need: a call cut off at its limit still returns the logs written.
# usage: bench/pairs-session.sh BIN_DIR OUT_DIR  (BIN_DIR: the staged .device/bin)
set -u
b=$1 out=$2
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step() { # seconds name command...
	local t=$1 n=$2
	shift 2
	local s=$SECONDS
	timeout "$t" "$@" >"$out/$n.log" 2>&1
	local rc=$?
	echo "== $n rc=$rc $((SECONDS - s)) s"
}
step 150 wgmma "$b/tests/test_moe_wgmma"
tail -3 "$out/wgmma.log"
step 120 moe "$b/tier-bench" moe --model qwen3-30b --model seed-896 --json
TIER_MOE_WGMMA_CLUSTER=2 step 120 moe-pairs "$b/tier-bench" moe --model qwen3-30b --model seed-896 --json
step 150 torch python3 bench/moe_torch.py --model qwen3-30b --model seed-896 --tier "$out/moe.log"
TIER_MOE_WGMMA_TILE=128x256 step 90 seed128 "$b/tier-bench" moe --model seed-896 --json
TIER_MOE_WGMMA_TILE=128x256 TIER_MOE_WGMMA_CLUSTER=2 step 90 seed128-pairs "$b/tier-bench" moe --model seed-896 --json
TIER_MOE_WGMMA_CLUSTER=2 step 120 moe_cuda-pairs "$b/tests/test_moe_cuda"
tail -2 "$out/moe_cuda-pairs.log"
step 60 dh_swiglu "$b/tests/test_moe_dh_swiglu"
tail -2 "$out/dh_swiglu.log"
for n in moe moe-pairs seed128 seed128-pairs; do echo "== $n"; grep -v "^{" "$out/$n.log" | grep -iE "gate|down|experts|block|permute|model|routing" | head -40; done
echo "== torch"; grep -v "^{" "$out/torch.log" | head -40
