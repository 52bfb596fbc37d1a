#!/usr/bin/env bash
# wgmma-watchdog.sh - the repro of the hang of gate/up with a LoRA segment on the TMA kernel
# (moe_wgmma.h, TIER_MOE_WGMMA_TMA=all), with the kernel's watchdog on: a wait over 2 s ends the
# kernel and the call fails naming the barrier (block, thread, full/empty/turn and stage, parity,
# the mbarrier's raw state).
#   bench/wgmma-watchdog.sh build BUILD_DIR OUT_BIN   here: test_moe_wgmma linked against BUILD_DIR's
#                                                    libtier.a with moe_wgmma.cu rebuilt -DTIER_WG_WATCHDOG=1
#   bench/wgmma-watchdog.sh run BIN OUT_DIR          on the GPU: the test with the TMA form of the repro
set -u
mode=${1:?build or run}
case $mode in
build)
	b=${2:?build dir}; bin=${3:?output binary}; src=$(cd "$(dirname "$0")/.." && pwd)
	var() { make -s -C "$b" --eval='print-%: ; @echo $($*)' "print-$1"; }
	flags=$(var NVCCFLAGS); deps=$(var TIER_DEP_LIBS); libs=$(var CMOCKA_LIBS)
	nvcc $flags -std=c++17 -I"$src/include" -I"$src" -I"$b" -DTIER_HAVE_CUDA=1 -DTIER_WG_WATCHDOG=1 \
		-c "$src/moe/moe_wgmma.cu" -o "$bin.wgmma.o" &&
	make -C "$b" tests/test_moe_wgmma.o libtier.la >/dev/null &&
	gcc -g -O2 -o "$bin" "$b/tests/test_moe_wgmma.o" "$bin.wgmma.o" "$b/.libs/libtier.a" $deps $libs &&
	rm -f "$bin.wgmma.o" && echo "built $bin"
	;;
run)
	bin=${2:?binary}; out=${3:?out dir}; mkdir -p "$out"
	# shellcheck source-path=SCRIPTDIR source=session-lib.sh
	. "$(dirname "$0")/session-lib.sh"
	step 300 watchdog stdbuf -oL "$bin"
	grep -E "watchdog|FAILED|PASSED|relative error" "$out/watchdog.log" | head -20
	cat "$sum"
	;;
*) echo "usage: $0 build BUILD_DIR OUT_BIN | run BIN OUT_DIR"; exit 2 ;;
esac
