#!/usr/bin/env bash
# moe-session.sh - the MoE kernels of issue 4 on the GPU in one call: test_moe_cuda with the
# experts through the grouped GEMMs where they fit (TIER_MOE_GROUPED=1), never (0: the per-expert
# cuBLASLt loop on lanes) and by the default rule, then `tier-bench moe` for every shape in both
# modes (its experts-fwd-g / block-fwd-g rows force the grouped path) and the torch peer
# (bench/moe_torch.py) in the same run. Logs under OUT.
# usage: bench/moe-session.sh BUILD_DIR OUT_DIR [MODEL...] (default: qwen3-30b seed-896 mixtral)
# SHAPES="T,H,I,E,k ..." adds shapes (e.g. the trainer's 4096,2048,768,128,8).
set -u
b=${1:?build dir}; out=${2:?out dir}; shift 2; mkdir -p "$out"
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(qwen3-30b seed-896 mixtral)
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
step 120 test_moe_cuda "$b/tests/test_moe_cuda"
TIER_MOE_GROUPED=0 step 120 test_moe_cuda-loop "$b/tests/test_moe_cuda"
TIER_MOE_GROUPED=1 step 120 test_moe_cuda-grouped "$b/tests/test_moe_cuda"
TIER_MOE_GROUPED=1 TIER_MOE_WGMMA=0 step 120 test_moe_cuda-mmasync "$b/tests/test_moe_cuda"
[ -x "$b/tests/test_moe_wgmma" ] && step 120 test_moe_wgmma "$b/tests/test_moe_wgmma"
[ -x "$b/tests/test_moe_skinny" ] && step 60 test_moe_skinny "$b/tests/test_moe_skinny"
args=(); for m in "${models[@]}"; do args+=(--model "$m"); done
for s in ${SHAPES:-}; do args+=(--shape "$s"); done
step 300 moe-auto "$b/tier-bench" moe "${args[@]}" --json
TIER_MOE_GROUPED=0 step 300 moe-loop "$b/tier-bench" moe "${args[@]}" --json
TIER_MOE_WGMMA=0 step 300 moe-mmasync "$b/tier-bench" moe "${args[@]}" --json
step 300 torch python3 bench/moe_torch.py "${args[@]}" --tier "$out/moe-auto.log"
for f in moe-auto moe-loop moe-mmasync torch; do echo "== $f"; grep -v '^{' "$out/$f.log" | tail -80; done
cat "$sum"
