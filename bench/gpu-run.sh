#!/usr/bin/env bash
# gpu-run.sh - run the GPU tests and benchmarks on a GPU machine from a build made elsewhere.
# usage: bench/gpu-run.sh BUILD_DIR OUT_DIR [tests|bench|all]
# The build must be static in libtier (configure --disable-shared) so that the test programs carry
# the library; other missing shared libraries are found through LD_LIBRARY_PATH (.device/lib).
set -u
build=${1:?build dir}; out=${2:?out dir}; what=${3:-all}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
summary="$out/summary.txt"; : > "$summary"
run() { # name, command...
	local name=$1; shift
	local t0; t0=$(date +%s.%N)
	"$@" > "$out/$name.log" 2>&1; local rc=$?
	printf '%-28s rc=%-3d %6.1fs\n' "$name" "$rc" "$(echo "$(date +%s.%N) - $t0" | bc)" | tee -a "$summary"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
	export TIER_TEST_SRCDIR=$PWD
	for t in "$build"/tests/test_*; do
		[ -x "$t" ] && [ -f "$t" ] || continue
		case "$t" in *.sh|*.o) continue;; esac
		run "$(basename "$t")" "$t"
	done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
	for sub in ${TIER_BENCHES:-store h2d d2h}; do
		run "bench-$sub" "$build/tier-bench" "$sub" --device cuda
	done
fi
cat "$summary"
