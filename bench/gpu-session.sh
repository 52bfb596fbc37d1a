#!/usr/bin/env bash
# gpu-session.sh - one call's worth of GPU work: the CUDA tests, then the benchmarks of the store,
# offload and MoE issues with their peers, logs under OUT. Every step has a time limit so that
# one hang cannot eat the lease. usage: bench/gpu-session.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
d=$(mktemp -d /tmp/tier-nvme.XXXXXX)
for t in test_base test_backend test_offload test_offload_cuda test_loss_cuda test_attn_cuda \
	 test_moe_router test_moe_layer test_moe_cuda; do
	step 90 "$t" "$b/tests/$t"
done
for s in h2d d2h; do step 60 "$s" "$b/tier-bench" $s --min-size 1M --size 256M --iters 5; done
for s in nvme-read nvme-write nvme-to-hbm; do
	step 90 "$s" "$b/tier-bench" $s --dir "$d" --min-size 16M --size 256M --iters 3
done
step 120 prefetch "$b/tier-bench" prefetch --device cuda
step 150 moe "$b/tier-bench" moe --model qwen3-30b --json
step 120 moe-torch python3 bench/moe_torch.py --model qwen3-30b --tier "$out/moe.log"
rm -rf "$d"
cat "$sum"
