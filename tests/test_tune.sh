#!/bin/sh
# test_tune.sh - a trace from a short default tier-run job, replayed by tier-tune within seconds:
# the tables, --json that parses, the recommendation, and bad input.
# Run from the build directory (make check does); the programs are ./tier-run and ./tier-tune.
set -u
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
[ -x ./tier-tune ] && [ -x ./tier-run ] || fail "./tier-run or ./tier-tune is not built (run make first)"

echo "# record a trace of 20 steps of the default job"
./tier-run --steps 20 --quiet --trace "$tmp/t.trc" >"$tmp/run" 2>&1 || fail "tier-run --trace: $(cat "$tmp/run")"
[ -s "$tmp/t.trc" ] || fail "no trace written"
head -c 8 "$tmp/t.trc" | grep -q TIERTRC1 || fail "trace lacks the magic"

echo "# replay it: tables for each pair, a recommendation, in seconds"
start=$(date +%s)
./tier-tune "$tmp/t.trc" --hbm 8M,14M,32M --ddr 256M >"$tmp/out" 2>"$tmp/err" || fail "tier-tune: $(cat "$tmp/err")"
end=$(date +%s)
[ $((end - start)) -le 20 ] || fail "tier-tune took $((end - start)) s"
for s in "hbm 8.00 MiB, ddr 256.00 MiB" "hbm 32.00 MiB" "gap hits" "# recommended: policy" "tier-run --policy"; do
	grep -q -- "$s" "$tmp/out" || fail "report lacks '$s': $(cat "$tmp/out")"
done
for p in lru lfu cost schedule min; do
	[ "$(grep -c "^$p " "$tmp/out")" -eq 3 ] || fail "policy $p not in every table"
done

echo "# --json parses; MIN bounds every policy's hits on this trace; more HBM never hits less under MIN"
./tier-tune "$tmp/t.trc" --hbm 8M,32M --ddr 256M --policy lru,schedule --json >"$tmp/j" 2>"$tmp/err" ||
	fail "tier-tune --json: $(cat "$tmp/err")"
python3 - "$tmp/j" <<'PY' || fail "json check"
import json, sys
d = json.load(open(sys.argv[1]))
rs = d["results"]
assert {r["policy"] for r in rs} == {"lru", "schedule", "min"}, rs
for h in (8 << 20, 32 << 20):
    m = [r for r in rs if r["hbm"] == h and r["policy"] == "min"][0]
    assert all(r["hbm_hits"] <= m["hbm_hits"] for r in rs if r["hbm"] == h), rs
    assert all(r["hbm_hits"] + r["hbm_misses"] + r["hbm_cold"] == d["results"][0]["hbm_hits"] + d["results"][0]["hbm_misses"] + d["results"][0]["hbm_cold"] for r in rs)
mins = sorted((r["hbm"], r["hbm_hits"]) for r in rs if r["policy"] == "min")
assert mins[0][1] <= mins[1][1], mins
assert d["recommend"]["policy"] in ("lru", "schedule"), d
r0 = d["results"][0]
assert d["trace"]["recorded_hbm_acquires"] == r0["hbm_hits"] + r0["hbm_misses"] + r0["hbm_cold"], d["trace"]
assert 0 < d["trace"]["recorded_hbm_hits"] < d["trace"]["recorded_hbm_acquires"], d["trace"]
PY

echo "# the recommended options run"
opts=$(grep "^tier-run " "$tmp/out" | sed 's/^tier-run //')
./tier-run --steps 2 --quiet $opts >"$tmp/run2" 2>&1 || fail "tier-run $opts: $(cat "$tmp/run2")"

echo "# bad input: clear errors, exit 1"
./tier-run --steps 1 --quiet --trace "$tmp/no/such/dir/t.trc" >/dev/null 2>"$tmp/err" && fail "unwritable --trace accepted"
grep -q -- "--trace: cannot create trace file" "$tmp/err" || fail "bad --trace: $(cat "$tmp/err")"
printf 'garbage' >"$tmp/bad.trc"
./tier-tune "$tmp/bad.trc" --hbm 8M --ddr 1G >/dev/null 2>"$tmp/err" && fail "garbage accepted"
grep -q "not a tier trace" "$tmp/err" || fail "garbage: $(cat "$tmp/err")"
head -c 100 "$tmp/t.trc" >"$tmp/cut.trc"
./tier-tune "$tmp/cut.trc" --hbm 8M --ddr 1G >/dev/null 2>"$tmp/err" && fail "truncated accepted"
grep -q "truncated record at offset 96" "$tmp/err" || fail "truncated: $(cat "$tmp/err")"
./tier-tune "$tmp/t.trc" --hbm 8M >/dev/null 2>"$tmp/err" && fail "missing --ddr accepted"
./tier-tune "$tmp/t.trc" --hbm 8M,x --ddr 1G >/dev/null 2>"$tmp/err" && fail "bad size accepted"
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 1G --policy fifo >/dev/null 2>"$tmp/err" && fail "bad policy accepted"
grep -q "fifo" "$tmp/err" || fail "bad policy: $(cat "$tmp/err")"
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 1G --link-gbps 0,6 >/dev/null 2>"$tmp/err" && fail "bad rate accepted"
./tier-tune "$tmp/t.trc" --hbm 64M --ddr 1G --total 1M >"$tmp/out" 2>&1 || fail "--total"
grep -q "no policy and split within" "$tmp/out" || fail "--total too small: $(cat "$tmp/out")"
echo "PASS"
