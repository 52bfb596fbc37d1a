#!/bin/sh
# test_stat_ranks.sh - tier-stat on a job of several ranks: two tier-run processes watched as one
# (-p PID,PID and --run DIR), the all row checked against the ranks' own figures, --json, a rank
# exiting while watched, and the error cases naming the rank's pid.
# Run from the build directory (make check does); CPU only, about 10 s.
set -u
tmp=$(mktemp -d) || exit 99
a='' b='' w='' other=''
cleanup() {
	for p in $w $a $b $other; do kill "$p" 2>/dev/null; done
	rm -f "/dev/shm/tier-stats.$other"
	rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
for p in tier-run tier-stat; do
	[ -x "./$p" ] || fail "./$p is not built (run make first)"
done
src=${TIER_TEST_SRCDIR:-..}

# Wait until process $1 publishes its statistics (tier-stat with no interval prints one row).
wait_published() {
	i=0
	until ./tier-stat -p "$1" >/dev/null 2>&1; do
		i=$((i + 1))
		[ $i -lt 300 ] || fail "process $1 never published statistics"
		kill -0 "$1" 2>/dev/null || { cat "$tmp"/run*.out; fail "process $1 exited before publishing"; }
		sleep 0.1
	done
}

# Two ranks of one "job": the default trainer, each with its own run directory DIR/rankN (the
# convention tier-stat --run DIR reads). Long enough (a minute or more) to outlive the test on a
# loaded machine; the test stops them.
mkdir "$tmp/run" || exit 99
for r in 0 1; do
	./tier-run --data "$src/data/corpus.txt" --steps 2000 --batch 2 --seq 32 --seed $((r + 1)) --quiet \
		--out "$tmp/run/rank$r" >"$tmp/run$r.out" 2>&1 &
	eval "p$r=\$!"
done
# shellcheck disable=SC2154 # p0, p1: set by the eval above
a=$p0 b=$p1
wait_published $a
wait_published $b

echo "# -p PID,PID: a row per rank and the all row"
./tier-stat -p $a,$b 0.2 5 >"$tmp/tab" 2>"$tmp/err"; rc=$?
cat "$tmp/tab"
[ $rc = 0 ] || fail "tier-stat -p $a,$b 0.2 5 exited $rc: $(cat "$tmp/err")"
grep -q '^rank  *pid  *time  *step ' "$tmp/tab" || fail "no rank and pid columns in the header"
for pat in "0  *$a" "1  *$b" "all  *-"; do
	n=$(grep -c "^ *$pat [0-9][0-9]:[0-9][0-9]:[0-9][0-9] " "$tmp/tab")
	[ "$n" = 5 ] || fail "expected 5 rows '$pat', got $n"
done
# Each interval: the all row's HBM used is the ranks' sum (to the rounding of the column) and its
# hit rate, recomputed from the summed counts, lies between the ranks' (a weighted mean does).
awk -v a=$a -v b=$b '
	$1 == "0" && $2 == a { split($5, u, "/"); u0 = u[1]; h0 = $6; next }
	$1 == "1" && $2 == b { split($5, u, "/"); u1 = u[1]; h1 = $6; next }
	$1 == "all" {
		split($5, u, "/"); n++
		d = u[1] - u0 - u1; if (d < 0) d = -d
		if (d > 0.15) { printf "all used %s != %s + %s\n", u[1], u0, u1; bad = 1 }
		if (h0 != "-" && h1 != "-") {
			lo = h0 < h1 ? h0 : h1; hi = h0 < h1 ? h1 : h0
			if ($6 == "-" || $6 + 0 < lo - 0.1 || $6 + 0 > hi + 0.1) {
				printf "all hit%% %s not in [%s, %s]\n", $6, lo, hi; bad = 1
			}
		}
	}
	END { exit bad || n != 5 }' "$tmp/tab" || fail "the all rows do not add up"

if command -v python3 >/dev/null; then
	echo "# --json: the ranks array and the all object"
	./tier-stat -p $a,$b --json 0.2 3 >"$tmp/json" || fail "tier-stat --json exited $?"
	python3 - "$tmp/json" $a $b <<'EOF' || fail "tier-stat --json with two ranks is wrong"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
pids = [int(p) for p in sys.argv[2:]]
assert len(rows) == 3, len(rows)
prev = None
for o in rows:
    rk, al = o["ranks"], o["all"]
    assert [r["rank"] for r in rk] == [0, 1] and [r["pid"] for r in rk] == pids, rk
    assert all(r["status"] == "running" for r in rk) and al["ranks_running"] == 2
    assert al["step"] == min(r["step"] for r in rk)
    for t in range(3):
        for k in ("hits", "misses", "evictions", "used", "capacity"):
            assert al["tiers"][t][k] == sum(r["tiers"][t][k] for r in rk), (t, k)
        # the all hit rate from the summed interval counts, not a mean of the ranks' rates
        d = lambda r, i, k: r["tiers"][t][k] - (prev["ranks"][i]["tiers"][t][k] if prev else 0)
        h = sum(d(r, i, "hits") for i, r in enumerate(rk))
        m = sum(d(r, i, "misses") for i, r in enumerate(rk))
        want = 100.0 * h / (h + m) if h + m else None
        got = al["tiers"][t]["hit_pct"]
        assert (got is None) == (want is None) and (want is None or abs(got - want) < 1e-4 * max(1, want)), (t, got, want)
    for l in range(8):
        assert al["links"][l]["bytes"] == sum(r["links"][l]["bytes"] for r in rk)
        g = [r["links"][l]["gbps"] for r in rk]
        assert abs(al["links"][l]["gbps"] - sum(g)) <= 1e-5 * max(1, sum(g)), (l, al["links"][l]["gbps"], g)
    assert al["prefetch"]["on_time"] == sum(r["prefetch"]["on_time"] for r in rk)
    prev = o
print("json: 3 intervals of 2 ranks, the all object adds up")
EOF
fi

echo "# --run DIR: rankN/tier.pid, and tier.pid with tier.N.pid"
./tier-stat --run "$tmp/run" 0.2 2 >"$tmp/tab" || fail "tier-stat --run $tmp/run exited $?"
grep -q "^ *0  *$a " "$tmp/tab" && grep -q "^ *1  *$b " "$tmp/tab" && grep -q '^ *all ' "$tmp/tab" ||
	fail "--run with rank0/ and rank1/ did not show both ranks: $(cat "$tmp/tab")"
mkdir "$tmp/flat"
echo $a >"$tmp/flat/tier.pid"
echo $b >"$tmp/flat/tier.1.pid"
./tier-stat --run "$tmp/flat" >"$tmp/tab" || fail "tier-stat --run $tmp/flat exited $?"
grep -q "^ *0  *$a " "$tmp/tab" && grep -q "^ *1  *$b " "$tmp/tab" ||
	fail "--run with tier.pid and tier.1.pid did not show both ranks: $(cat "$tmp/tab")"
echo $a >"$tmp/flat/tier.0.pid"
echo $b >"$tmp/flat/tier.1.pid"
mkdir "$tmp/flat/rank1" && echo $b >"$tmp/flat/rank1/tier.pid"
./tier-stat --run "$tmp/flat" 2>"$tmp/err"; rc=$?
[ $rc = 1 ] && grep -q "rank 1 given twice" "$tmp/err" || fail "two pid files for rank 1: exit $rc, $(cat "$tmp/err")"

echo "# one process: the table of old, unless --ranks"
./tier-stat --run "$tmp/run/rank0" >"$tmp/tab" || fail "tier-stat --run DIR/rank0 exited $?"
grep -q '^[0-9][0-9]:[0-9][0-9]:[0-9][0-9] ' "$tmp/tab" && ! grep -q '^rank' "$tmp/tab" ||
	fail "a single rank should print the table without rank columns: $(cat "$tmp/tab")"
./tier-stat -p $a --ranks >"$tmp/tab" || fail "tier-stat -p $a --ranks exited $?"
grep -q "^ *0  *$a " "$tmp/tab" && grep -q '^ *all ' "$tmp/tab" || fail "--ranks: $(cat "$tmp/tab")"

echo "# errors name the pid"
dead=999999
while kill -0 $dead 2>/dev/null; do dead=$((dead + 1)); done
./tier-stat -p $a,$dead 0.2 2 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc = 2 ] || fail "-p $a,$dead exited $rc, expected 2"
grep -q "rank 1 (pid $dead): no process $dead" "$tmp/err" || fail "-p $a,$dead: $(cat "$tmp/err")"
./tier-stat -p $$,$a 2>"$tmp/err" >/dev/null; rc=$?
[ $rc = 2 ] && grep -q "rank 0 (pid $$): .*publishes no tier statistics" "$tmp/err" ||
	fail "-p $$,$a (no segment): exit $rc, $(cat "$tmp/err")"
./tier-stat -p $a,$a 2>/dev/null; [ $? = 1 ] || fail "a pid given twice should exit 1"
./tier-stat -p $a, 2>/dev/null; [ $? = 1 ] || fail "-p '$a,' should exit 1"
./tier-stat -p $a -r "$tmp/run" 2>/dev/null; [ $? = 1 ] || fail "-p with --run should exit 1"
if command -v python3 >/dev/null && [ -d /dev/shm ]; then
	# A rank whose segment is of another version (a job of another build) is refused with 3.
	sleep 30 & other=$!
	python3 -c 'import struct,sys; open(sys.argv[1],"wb").write(struct.pack("<QII",0x5441545352454954,99,1600)+bytes(1584))' \
		"/dev/shm/tier-stats.$other"
	./tier-stat -p $a,$b,$other 2>"$tmp/err" >/dev/null; rc=$?
	rm -f "/dev/shm/tier-stats.$other"; kill $other; other=
	[ $rc = 3 ] && grep -q "rank 2 (pid [0-9]*): segment of tier stats version 99" "$tmp/err" ||
		fail "mixed versions: exit $rc, $(cat "$tmp/err")"
fi

echo "# a rank that exits while watched: shown exited, the other goes on, exit 4 at the end"
./tier-stat -p $a,$b 0.1 >"$tmp/tab" 2>"$tmp/err" & w=$!
sleep 0.5
kill -TERM $b; wait $b; b=
sleep 0.6
kill -0 $w 2>/dev/null || fail "tier-stat stopped when one of two ranks exited: $(cat "$tmp/err")"
kill -TERM $a; wait $a; a=
i=0
while kill -0 $w 2>/dev/null; do
	i=$((i + 1)); [ $i -lt 50 ] || fail "tier-stat did not stop after the last rank exited"
	sleep 0.1
done
wait $w; rc=$?; w=
tail -6 "$tmp/tab"
[ $rc = 4 ] || fail "tier-stat exited $rc when the ranks exited, expected 4 ($(cat "$tmp/err"))"
grep -q "rank 1 (pid $p1) exited" "$tmp/err" || fail "no message for rank 1: $(cat "$tmp/err")"
awk -v a=$p0 -v b=$p1 '$1 == "1" && $2 == b && / exited$/ { e = 1; next }
	e && $1 == "0" && $2 == a && $5 ~ /\// { after++ } END { exit !(after >= 1) }' "$tmp/tab" ||
	fail "after rank 1 exited, rank 0 rows did not go on"
echo "PASS"
