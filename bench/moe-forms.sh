#!/usr/bin/env bash
# moe-forms.sh - test_moe_wgmma under TEST_ENV (default: none, where the test runs every form and
# both idle settings itself; TESTS=" " skips it), then tier-bench moe under each form of VARIANTS
# (';'-separated, each space-separated VAR=VALUE; "" the defaults), ROUNDS times in turn, on MODELS
# (default seed-896) with ROUTING (default both), then torch's figures in the same call against the
# last variant (bench/moe_torch.py). Session 31's question: the idle consumers
# (TIER_MOE_WGMMA_IDLE=1) lost the weights' reuse in L2 when every CTA takes each grid-th tile; do
# they keep it when the CTAs claim tiles in turn (TIER_MOE_WGMMA_SCHED=dynamic), or on CTA pairs
# (TIER_MOE_WGMMA_CLUSTER=2, whose two CTAs share the weights' tile by multicast), and what do
# ping-pong 64-row tiles give on an H200. Prints each product's median over the variant's rounds
# and its ratio to the first variant's (by default the fixed order, SCHED=static). About 100 s for
# the test, 25 s a variant and round on seed-896 with both routings, 40 s for torch.
# usage: bench/moe-forms.sh BIN_DIR OUT_DIR
set -u
b=${1:?bin dir}; out=${2:?out dir}; mkdir -p "$out"
. "$(dirname "$0")/session-lib.sh" # prints the GPU; read_variants
hung=0 test_env=${TEST_ENV-} # the test's settings ("": its defaults)
for t in ${TESTS:-test_moe_wgmma}; do
	# shellcheck disable=SC2086 # the settings are separate words
	env $test_env timeout 200 "$b/tests/$t" > "$out/$t.log" 2>&1
	rc=$?; [ $rc = 124 ] && hung=1
	echo "== $t (${test_env:-defaults}) rc=$rc"; tail -3 "$out/$t.log"
done
read_variants "TIER_MOE_WGMMA_SCHED=static;;TIER_MOE_WGMMA_TILE=pp64x256;TIER_MOE_WGMMA_CLUSTER=2 TIER_MOE_WGMMA_IDLE=1;TIER_MOE_WGMMA_SCHED=dynamic"
if [ $hung = 1 ]; then # a test that hung: the dynamic schedule (the default for small groups) is the likely cause
	for i in "${!vars[@]}"; do # the fixed order for every variant (env takes the last setting)
		case ${vars[$i]} in *SCHED=static*) ;; *) vars[i]="${vars[$i]:+${vars[$i]} }TIER_MOE_WGMMA_SCHED=static"
			echo "== the test hung: variant $i in the fixed order (${vars[$i]})";; esac
	done
fi
models=()
for m in ${MODELS:-seed-896}; do models+=(--model "$m"); done
for r in $(seq 1 "${ROUNDS:-1}"); do
	for i in "${!vars[@]}"; do
		# shellcheck disable=SC2086 # the settings are separate words
		env ${vars[$i]} timeout 120 "$b/tier-bench" moe "${models[@]}" --routing "${ROUTING:-both}" --json \
			> "$out/v$i-r$r.log" 2>&1
		echo "== round $r variant $i (${vars[$i]:-default}) rc=$?"
	done
done
# per product and shape: each variant's median over the rounds (us), and its ratio to variant 0's
echo "us, median of the rounds (ratio to variant 0): $(for i in "${!vars[@]}"; do printf '| %s: %s ' "$i" "${vars[$i]:-default}"; done)"
for i in "${!vars[@]}"; do
	cat "$out"/v"$i"-r*.log | awk -v v="$i" '$3 ~ /^(gate-up|gate-up-mm|down|experts-fwd|experts-bwd|block-fwd\+bwd)$/ {
		print v, $1 " " $2 " " $3, ($5 == "ms" ? $4 * 1000 : $4) }'
done | sort -k1,1n -k2,4 -k5,5g | awk '
	{ k = $2 " " $3 " " $4; n[$1, k]++; t[$1, k, n[$1, k]] = $5; keys[k] = 1; if ($1 > nv) nv = $1 }
	END {
		for (k in keys) {
			line = sprintf("%-34s", k)
			for (v = 0; v <= nv; v++) {
				c = n[v, k]; m = c ? t[v, k, int((c + 1) / 2)] : 0
				if (v == 0) base = m
				line = line sprintf(" %9.1f", m) (v && base ? sprintf(" (%.2f)", m / base) : "")
			}
			print line
		}
	}' | sort
last=$(( ${#vars[@]} - 1 ))
timeout 100 python3 bench/moe_torch.py "${models[@]}" --tier "$out/v$last-r1.log" > "$out/torch.log" 2>&1
echo "== torch against variant $last rc=$?"; grep -E "^ +(qwen3|seed|mixtral)" "$out/torch.log"
