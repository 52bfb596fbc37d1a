#!/usr/bin/env bash
# validate-session22.sh - session 22's GPU forms written without a GPU, on one: the CUDA tests of
# the paths they touch (test_attn_cuda runs TIER_ATTN_BWD_DS=stm with either dQ path itself,
# test_ops_cuda both TIER_LORA_FIRST orders), test_golden_cuda under every new form at once, then
# STAGES=attnq (the attention backward's forms against torch) and (a) under the new forms against
# the defaults in the same call. Every test's output goes to tests.txt, the rest to next-session.sh's
# files (summary.txt, logs.tgz): few files, as a call returns at most eight.
# usage: bench/validate-session22.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
{
	for t in test_attn_cuda test_ops_cuda test_golden_cuda; do
		timeout 120 "$b/tests/$t" > "$out/$t.log" 2>&1; echo "== $t rc=$?"; tail -25 "$out/$t.log"; rm -f "$out/$t.log"
	done
	TIER_LORA_FIRST=1 TIER_ATTN_BWD_DS=stm TIER_ATTN_BWD_DQ=tma timeout 60 "$b/tests/test_golden_cuda" > "$out/g.log" 2>&1
	echo "== test_golden_cuda (TIER_LORA_FIRST=1 TIER_ATTN_BWD_DS=stm TIER_ATTN_BWD_DQ=tma) rc=$?"; tail -12 "$out/g.log"
	rm -f "$out/g.log"
} > "$out/tests.txt" 2>&1
grep "^== " "$out/tests.txt"
if [ "${QUICK:-0}" = 1 ]; then # QUICK=1: the attention benchmark's forms, then (a) under the new forms
	for v in "" "TIER_ATTN_BWD_DS=stm" "TIER_ATTN_BWD_DS=stm TIER_ATTN_BWD_DQ=tma"; do
		echo "== attn ${v:-default}"
		# shellcheck disable=SC2086 # the settings are separate words
		env $v timeout 60 "$b/tier-bench" attn 2>&1 | grep -E "fwd|bwd"
	done > "$out/attn.txt"
	cat "$out/attn.txt"
	. "$(dirname "$0")/session-lib.sh"
	a=("${job_args[@]}" --config bench/configs/qwen3-30b-a3b.json --batch 1 --steps 6 --ddr 4G --op-cache all:hbm=48G)
	for v in "" "TIER_LORA_FIRST=1 TIER_ATTN_BWD_DS=stm TIER_ATTN_BWD_DQ=tma"; do
		echo "== (a) ${v:-default}"
		# shellcheck disable=SC2086
		env $v timeout 90 "$b/tier-run" "${a[@]}" 2>&1 | grep -E "^ +[0-9]+ |^# done|rror"
	done > "$out/train-a.txt"
	cat "$out/train-a.txt"
	exit 0
fi
STAGES=attnq,a A_ALT="TIER_LORA_FIRST=1,TIER_ATTN_BWD_DS=stm TIER_LORA_FIRST=1,TIER_ATTN_BWD_DS=stm,TIER_ATTN_BWD_DQ=tma" \
	"$(dirname "$0")/next-session.sh" "$b" "$out"
