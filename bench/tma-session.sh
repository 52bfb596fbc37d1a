#!/usr/bin/env bash
# tma-session.sh - the wgmma products' loaders compared on the GPU in one call: test_moe_wgmma
# (TMA and cp.async cases), then `tier-bench moe` with the TMA loads (the default) and with
# TIER_MOE_WGMMA_TMA=0 (cp.async everywhere), seed-896's tiles with TMA, and the torch peer, all
# with 200 ms warm-ups. Six logs under OUT (a call brings back at most eight files).
# usage: bench/tma-session.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
step 150 test_moe_wgmma "$b/tests/test_moe_wgmma"
args=(--model qwen3-30b --model seed-896 --warmup-ms 200)
step 100 moe-tma "$b/tier-bench" moe "${args[@]}" --json
TIER_MOE_WGMMA_TMA=0 step 100 moe-cpasync "$b/tier-bench" moe "${args[@]}" --json
tiles() {
	for t in 128x256 pp128x128 pp64x256; do
		echo "== TMA tile $t"
		TIER_MOE_WGMMA_TILE=$t "$b/tier-bench" moe --model seed-896 --warmup-ms 200 | grep -E 'gate-up|down|experts-'
	done
}
export b; export -f tiles
step 100 tma-tiles bash -c tiles
step 100 torch python3 bench/moe_torch.py "${args[@]}" --tier "$out/moe-tma.log"
for f in moe-tma moe-cpasync tma-tiles torch; do echo "== $f"; grep -v '^{' "$out/$f.log" | grep -E 'gate|down|experts|==' ; done
cat "$sum"
