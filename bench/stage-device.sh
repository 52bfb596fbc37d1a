#!/usr/bin/env bash
# stage-device.sh - make the pack that bench/next-session.sh runs on the GPU machine: builds the
# programs and CUDA tests in BUILD_DIR (a static build: `../configure --disable-shared`, so that the
# pack needs no libtier), strips them into .device/bin (tests under .device/bin/tests), packs them
# as .device/pack.tar.xz (the carry limit is 64 MiB; about 6 MB packed), stages the shared
# libraries the GPU machine lacks into .device/lib with the device tools' stage-libs.sh (STAGE_LIBS,
# default ../shared/device/stage-libs.sh) and records the commit in .device/PACK_COMMIT (with
# "+dirty" when the working tree has changes git tracks). Run from the repository root.
# usage: bench/stage-device.sh BUILD_DIR
# On the device: carry [".device/pack.tar.xz", ".device/lib"] and start the command with
#   tar xJf .device/pack.tar.xz -C .device && export LD_LIBRARY_PATH=$PWD/.device/lib:$LD_LIBRARY_PATH;
set -eu
b=${1:?usage: bench/stage-device.sh BUILD_DIR (a --disable-shared build)}
[ -f "$b/Makefile" ] || { echo "stage-device.sh: $b has no Makefile; configure a build there first" >&2; exit 1; }
[ -d .git ] || { echo "stage-device.sh: run it from the repository root" >&2; exit 1; }
tests="test_attn_cuda test_moe_cuda test_moe_wgmma test_moe_dh_swiglu test_moe_skinny test_ops_cuda test_golden_cuda test_loss_cuda test_offload_cuda"
targets="tier-run tier-bench"
for t in $tests; do targets="$targets tests/$t"; done
# shellcheck disable=SC2086 # the targets' words
make -C "$b" -j"$(nproc)" $targets
rm -rf .device/bin && mkdir -p .device/bin/tests
for p in tier-run tier-bench; do
	if file "$b/$p" | grep -q 'shell script'; then
		echo "stage-device.sh: $b/$p is a libtool wrapper; use a --disable-shared build" >&2
		exit 1
	fi
	cp "$b/$p" .device/bin/
done
for t in $tests; do cp "$b/tests/$t" .device/bin/tests/; done
strip .device/bin/tier-run .device/bin/tier-bench .device/bin/tests/*
tar cJf .device/pack.tar.xz -C .device bin
"${STAGE_LIBS:-../shared/device/stage-libs.sh}" .device/bin
# the CUPTI kernel profiler (next-session.sh STAGES=kprof, KPROF_LIB=$PWD/.device/lib/libtier-kprof.so)
make -C "$b" tools/libtier-kprof.so > /dev/null 2>&1 && cp "$b/tools/libtier-kprof.so" .device/lib/ ||
	echo "stage-device.sh: no tools/libtier-kprof.so in $b (a CUDA build with CUPTI makes it): no kprof stage"
rev=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- || rev="$rev+dirty"
echo "$rev" > .device/PACK_COMMIT
echo "staged $rev: $(du -h .device/pack.tar.xz | cut -f1) packed, libraries in .device/lib"
