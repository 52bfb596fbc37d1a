#!/bin/sh
# test_prefetch_bench.sh - tier-bench prefetch end to end on the CPU with small sizes: it runs, prints
# its table and summary, its prefetch statistics add up, and bad arguments fail cleanly. Not timing-
# gated (CI machines are noisy): PASS or FAIL in the summary is only checked to be there.
# Run from the build directory (make check does); the program is ./tier-bench.
set -u
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
[ -x ./tier-bench ] || fail "./tier-bench is not built (run make first)"

L=12 W=1048576 N=2
echo "# tier-bench prefetch --device cpu --layers $L --layer-bytes $W --steps $N --json"
./tier-bench prefetch --device cpu --layers $L --layer-bytes $W --steps $N --link-gbps 2 --json \
	>"$tmp/out" 2>"$tmp/err"; rc=$?
cat "$tmp/out"
[ $rc = 0 ] || { cat "$tmp/err"; fail "tier-bench prefetch exited $rc"; }
head -1 "$tmp/out" | grep -q '^# tier-bench prefetch:' || fail "first line does not say what the benchmark is"
grep -q '^#  *mode  *hbm  *window  *step ' "$tmp/out" || fail "no table header"
for m in resident prefetch demand; do
	[ "$(grep -c "^  *$m  " "$tmp/out")" = 1 ] || fail "no single table row for mode $m"
done
grep -Eq '^# summary: prefetch/resident = [0-9]+\.[0-9]+x \(gate 0\.90: (PASS|FAIL)\)' "$tmp/out" ||
	fail "no summary line 'prefetch/resident = X.XXx (gate 0.90: PASS|FAIL)'"

# The JSON line: one object per mode; check the counters of each.
json=$(grep '^{"bench":"prefetch"' "$tmp/out") || fail "no JSON line"
if command -v python3 >/dev/null; then
	echo "$json" | python3 -c 'import json,sys; json.load(sys.stdin)' || fail "invalid JSON"
fi
echo "$json" | sed 's/.*"modes":\[{//; s/}\],"gate".*//; s/},{/\n/g' >"$tmp/modes"
[ "$(wc -l <"$tmp/modes")" = 3 ] || fail "expected 3 modes in the JSON"
needs_expected=$((2 * L * N))
while read -r line; do
	get() { v=$(echo "$line" | sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"); [ -n "$v" ] || fail "no field $1 in: $line"; echo "$v"; }
	mode=$(echo "$line" | sed -n 's/.*"mode":"\([a-z]*\)".*/\1/p')
	needs=$(get needs) on_time=$(get on_time) late=$(get late) missed=$(get missed)
	res=$(get resident) issued=$(get issued) h2d=$(get h2d_bytes)
	echo "# $mode: needs $needs = on_time $on_time + late $late + missed $missed + resident $res; issued $issued; h2d $h2d"
	[ "$needs" = $needs_expected ] || fail "$mode: $needs needs, expected 2 x $L layers x $N steps = $needs_expected"
	[ $((on_time + late + missed + res)) = "$needs" ] || fail "$mode: on_time + late + missed + resident != needs"
	fetched=$((on_time + late + missed))
	[ "$h2d" -ge $((fetched * W)) ] || fail "$mode: $h2d bytes moved on h2d, less than $fetched fetches of $W"
	[ "$h2d" -le $(((issued + missed) * W)) ] || fail "$mode: $h2d bytes moved, more than $issued prefetches + $missed misses"
	[ $((on_time + late)) -le "$issued" ] || fail "$mode: more prefetched needs than prefetches issued"
	case $mode in
	resident) [ "$fetched" = 0 ] && [ "$issued" = 0 ] && [ "$h2d" = 0 ] || fail "resident: data moved" ;;
	prefetch) [ "$issued" -gt 0 ] && [ "$fetched" -gt 0 ] || fail "prefetch: nothing prefetched" ;;
	demand) [ "$issued" = 0 ] && [ "$on_time" = 0 ] && [ "$late" = 0 ] && [ "$missed" -gt 0 ] ||
		fail "demand: prefetches seen, or no demand misses" ;;
	*) fail "unknown mode '$mode'" ;;
	esac
done <"$tmp/modes"

echo "# bad arguments: exit 1 with a message"
bad() {
	./tier-bench prefetch "$@" >"$tmp/out" 2>"$tmp/err"; rc=$?
	[ $rc = 1 ] || fail "tier-bench prefetch $* exited $rc, expected 1"
	grep -q 'tier-bench prefetch' "$tmp/err" || fail "tier-bench prefetch $*: no message on stderr"
}
bad --layers 8                 # 1/4 of 8 layers cannot hold the window of 2 plus the layer computing
bad --layers 12 --window 3
bad --layer-bytes 1000          # not a multiple of 4 KiB
bad --compute-ratio 0
bad --compute-ratio abc
bad --link-gbps -1
bad --steps 0
bad --device tpu
bad --bogus
bad extra
./tier-bench prefetch --help | grep -q -- '--compute-ratio' || fail "--help does not list the options"
echo "PASS"
