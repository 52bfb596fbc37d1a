#!/usr/bin/env bash
# forms-ab.sh - one GPU call that checks and times forms against the defaults: the CUDA tests named
# in TESTS (each once by default and, with TEST_FORMS, once more under those settings), then the
# trainer's job (a) under each variant of VARIANTS (';'-separated, each space-separated VAR=VALUE;
# "" the defaults; words from the first that starts with -- are tier-run options added after A_ARGS,
# e.g. "TIER_MOE_KEEP_H=0 --batch 6 --micro-batches 2"), ROUNDS times in turn so that drift in the machine falls on every variant alike.
# Each run prints its per-step rates; ab.txt ends with each variant's median of the steps after
# the first, over all its rounds, and its ratio to the first variant's. KPROF=1 adds a 3-step
# kernel profile of (a) by default (kprof.txt) with its timeline (trace.txt.gz), where
# stage-device.sh staged tools/libtier-kprof.so.
# Knobs: A_ARGS (default "--batch 3 --ddr 4G --op-cache all:hbm=56G"), STEPS (6), ROUNDS (2).
# usage: bench/forms-ab.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
{
	for t in ${TESTS:-test_ops_cuda test_golden_cuda}; do
		timeout 200 "$b/tests/$t" > "$out/t.log" 2>&1; echo "== $t rc=$?"; tail -8 "$out/t.log"
		if [ -n "${TEST_FORMS:-}" ]; then
			# shellcheck disable=SC2086 # the settings are separate words
			env $TEST_FORMS timeout 200 "$b/tests/$t" > "$out/t.log" 2>&1
			echo "== $t ($TEST_FORMS) rc=$?"; tail -4 "$out/t.log"
		fi
	done
	rm -f "$out/t.log"
} > "$out/tests.txt" 2>&1
grep "^== " "$out/tests.txt"
read -r -a extra <<< "${A_ARGS:---batch 3 --ddr 4G --op-cache all:hbm=56G}"
a=("${job_args[@]}" --config bench/configs/qwen3-30b-a3b.json "${extra[@]}" --steps "${STEPS:-6}")
read_variants ""
for r in $(seq 1 "${ROUNDS:-2}"); do
	for i in "${!vars[@]}"; do
		v=${vars[$i]} envs=() more=()
		echo "== round $r variant $i: ${v:-default}"
		# the settings, then from the first word that starts with -- the trainer's own options
		for w in $v; do
			if [ ${#more[@]} -gt 0 ] || [[ $w == --* ]]; then more+=("$w"); else envs+=("$w"); fi
		done
		env "${envs[@]}" timeout 150 "$b/tier-run" "${a[@]}" "${more[@]}" 2>&1 |
			grep -E "^ +[0-9]+ |^# done|^# op cache|^# hbm|^# time by part|rror"
	done
done > "$out/ab.txt"
# the medians: per variant, the rates of every step after the first, all rounds together
awk '/^== round/ { sub(/^== round [0-9]+ variant /, ""); split($0, p, ":"); v = p[1]; name[v] = substr($0, length(p[1]) + 3); next }
     /^ +[0-9]+ / && $1 > 1 { n[v]++; r[v, n[v]] = $4 }
     END { for (v = 0; v in n; v++) {
		m = n[v]; for (i = 1; i <= m; i++) s[i] = r[v, i]
		for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (s[j] < s[i]) { t = s[i]; s[i] = s[j]; s[j] = t }
		med = m % 2 ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
		if (v == 0) base = med
		printf "median variant %d (%s): %.0f tokens/s over %d steps, %.4f of variant 0\n", v, name[v], med, m, med / base } }' \
	"$out/ab.txt" >> "$out/ab.txt"
cat "$out/ab.txt"
kp=$PWD/.device/lib/libtier-kprof.so
if [ "${KPROF:-0}" = 1 ] && [ -f "$kp" ]; then
	CUDA_INJECTION64_PATH="$kp" TIER_KPROF_OUT="$out/kprof.txt" TIER_KPROF_TOP=80 TIER_KPROF_TRACE="$out/trace.txt" \
		timeout 150 "$b/tier-run" "${a[@]}" --steps 3 > /dev/null 2>&1
	echo "== kprof rc=$?"; head -30 "$out/kprof.txt" 2>/dev/null; gzip -f "$out/trace.txt" 2>/dev/null
fi
exit 0
