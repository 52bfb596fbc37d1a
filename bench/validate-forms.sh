#!/usr/bin/env bash
# validate-forms.sh - GPU forms beside the defaults, on one: the CUDA tests of the paths they touch
# (test_attn_cuda runs the attention backward's other dS and dQ forms itself, test_ops_cuda both
# TIER_LORA_FIRST orders, test_moe_cuda every TIER_MOE_WGRAD_TILE, test_moe_skinny both row tiles),
# test_golden_cuda under $FORMS at once, then `tier-bench lora` (every reduction tile and rank
# product tiling against the copy) and `tier-bench attn` under the attention's forms, and (a) under
# $FORMS against the defaults in the same call. FORMS (space-separated VAR=VALUE) defaults to the
# forms before session 23 (its first GPU call ran this script with the then-new forms).
# Every test's output goes to tests.txt (its tail), the benchmarks' to lora.txt, attn.txt and
# train-a.txt: few files, as a call returns at most eight. Without QUICK=1, after the tests:
# next-session.sh STAGES=attnq,a with torch and A_ALT (about 300 s more). QUICK=1 KPROF=1 adds a
# kernel profile of (a) under the new forms.
# usage: bench/validate-forms.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
new=${FORMS:-"TIER_LORA_FIRST=0 TIER_ATTN_BWD_DS=scalar TIER_ATTN_BWD_DQ=atomic"}
{
	for t in ${TESTS:-test_attn_cuda test_ops_cuda test_golden_cuda test_moe_skinny test_moe_cuda}; do
		timeout 200 "$b/tests/$t" > "$out/$t.log" 2>&1; echo "== $t rc=$?"; tail -25 "$out/$t.log"; rm -f "$out/$t.log"
	done
	# shellcheck disable=SC2086 # the settings are separate words
	env $new timeout 60 "$b/tests/test_golden_cuda" > "$out/g.log" 2>&1
	echo "== test_golden_cuda ($new) rc=$?"; tail -12 "$out/g.log"
	rm -f "$out/g.log"
} > "$out/tests.txt" 2>&1
grep "^== " "$out/tests.txt"
if [ "${QUICK:-0}" = 1 ]; then # QUICK=1: the benchmarks of the forms, then (a) under the new forms
	timeout 90 "$b/tier-bench" lora > "$out/lora.txt" 2>&1
	cat "$out/lora.txt"
	for v in "" "TIER_ATTN_BWD_DQ=atomic" "TIER_ATTN_BWD_DS=scalar TIER_ATTN_BWD_DQ=atomic"; do
		echo "== attn ${v:-default}"
		# shellcheck disable=SC2086
		env $v timeout 60 "$b/tier-bench" attn 2>&1 | grep -E "fwd|bwd"
	done > "$out/attn.txt"
	cat "$out/attn.txt"
	. "$(dirname "$0")/session-lib.sh"
	a=("${job_args[@]}" --config bench/configs/qwen3-30b-a3b.json --batch 1 --steps 6 --ddr 4G --op-cache all:hbm=48G)
	for v in "" "$new"; do
		echo "== (a) ${v:-default}"
		# shellcheck disable=SC2086
		env $v timeout 90 "$b/tier-run" "${a[@]}" 2>&1 | grep -E "^ +[0-9]+ |^# done|rror"
	done > "$out/train-a.txt"
	cat "$out/train-a.txt"
	# KPROF=1: (a) under the new forms for 3 steps under the CUPTI kernel profiler (kprof-a.txt:
	# the time by kernel, the top 60), where stage-device.sh staged tools/libtier-kprof.so
	kp=$PWD/.device/lib/libtier-kprof.so
	if [ "${KPROF:-0}" = 1 ] && [ -f "$kp" ]; then
		# shellcheck disable=SC2086
		env $new CUDA_INJECTION64_PATH="$kp" TIER_KPROF_OUT="$out/kprof-a.txt" TIER_KPROF_TOP=60 \
			timeout 120 "$b/tier-run" "${a[@]}" --steps 3 > /dev/null 2>&1
		echo "== kprof rc=$?"; head -40 "$out/kprof-a.txt" 2>/dev/null
	fi
	exit 0
fi
STAGES=attnq,a A_ALT="${new// /,}" \
	"$(dirname "$0")/next-session.sh" "$b" "$out"
