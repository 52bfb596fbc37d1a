#!/usr/bin/env bash
# moe-session.sh - the MoE kernels of issue 4 on the GPU in one call: test_moe_cuda with the
# per-expert products on one stream and on lanes, then `tier-bench moe` for every shape with
# TIER_MOE_LANES=1 and 4 (the experts-fwd-g rows: the device-side grouped GEMM) and the torch peer
# (bench/moe_torch.py) in the same run. Logs under OUT.
# usage: bench/moe-session.sh BUILD_DIR OUT_DIR [MODEL...] (default: qwen3-30b seed-896 mixtral)
set -u
b=${1:?build dir}; out=${2:?out dir}; shift 2; mkdir -p "$out"
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(qwen3-30b seed-896 mixtral)
. "$(dirname "$0")/session-lib.sh"
step 120 test_moe_cuda "$b/tests/test_moe_cuda"
TIER_MOE_LANES=1 step 120 test_moe_cuda-1lane "$b/tests/test_moe_cuda"
for m in "${models[@]}"; do
	for l in 1 4; do TIER_MOE_LANES=$l step 200 "moe-$m-l$l" "$b/tier-bench" moe --model "$m" --json; done
	step 200 "torch-$m" python3 bench/moe_torch.py --model "$m" --tier "$out/moe-$m-l4.log"
done
for m in "${models[@]}"; do
	for f in "$out/moe-$m-l1.log" "$out/moe-$m-l4.log" "$out/torch-$m.log"; do
		echo "== $f"; grep -v '^{' "$f" | tail -30
	done
done
cat "$sum"
