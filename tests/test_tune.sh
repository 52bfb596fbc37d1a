#!/bin/sh
# test_tune.sh - a trace from a short default tier-run job, replayed by tier-tune within seconds:
# the tables, --json that parses, the recommendation, the prefetch-overlap stall, and bad input.
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
assert d["trace"]["steps"] == 20 and d["trace"]["operations"] >= 20, d["trace"]
assert d["op_s"] is None and d["recommend"]["basis"] == "no_overlap", d["recommend"]
assert all(r["overlap_stall_s"] is None and r["step_s"] is None for r in rs), rs
PY

echo "# with a compute time: 0 <= overlap stall <= no-overlap stall, equal with window 0, and the"
echo "# recommendation is the least overlap stall"
./tier-tune "$tmp/t.trc" --hbm 4M,8M,14M --ddr 16M,256M --op-ms 0.2 >"$tmp/out2" 2>"$tmp/err" ||
	fail "tier-tune --op-ms: $(cat "$tmp/err")"
for s in "overlap s" "step ms" "# compute 0.200 ms per operation" "prefetch window 2" "with prefetch"; do
	grep -q -- "$s" "$tmp/out2" || fail "report lacks '$s': $(cat "$tmp/out2")"
done
for w in 0 2; do
	./tier-tune "$tmp/t.trc" --hbm 4M,8M,14M --ddr 16M,256M --op-ms 0.2 --window $w --json >"$tmp/j$w" 2>"$tmp/err" ||
		fail "tier-tune --window $w --json: $(cat "$tmp/err")"
done
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 256M --step-s 0.004 --json >"$tmp/js" 2>"$tmp/err" ||
	fail "tier-tune --step-s: $(cat "$tmp/err")"
python3 - "$tmp/j0" "$tmp/j2" "$tmp/js" <<'PY' || fail "overlap json check"
import json, sys
z, d, s = (json.load(open(f)) for f in sys.argv[1:])
assert d["window"] == 2 and z["window"] == 0 and abs(d["op_s"] - 2e-4) < 1e-12, (d["window"], d["op_s"])
ops, steps = d["trace"]["operations"], d["trace"]["steps"]
for r in d["results"]:
    assert 0 <= r["overlap_stall_s"] <= r["stall_s"] + 2e-6, r
    assert abs(r["compute_s"] - ops * 2e-4) < 1e-6, r
    assert abs(r["step_s"] - (r["compute_s"] + r["overlap_stall_s"]) / steps) < 1e-6, r
    assert abs(r["step_no_overlap_s"] - (r["compute_s"] + r["stall_s"]) / steps) < 1e-6, r
    assert r["demand_ops"] <= r["xfer_ops"] <= ops and r["stalled_ops"] <= r["xfer_ops"], r
assert any(r["overlap_stall_s"] < 0.9 * r["stall_s"] for r in d["results"]), "prefetch hid nothing"
for r in z["results"]:
    assert abs(r["overlap_stall_s"] - r["stall_s"]) < 2e-6 and r["demand_ops"] == r["xfer_ops"], r
rec = d["recommend"]
best = min(r["overlap_stall_s"] for r in d["results"] if r["policy"] != "min")
assert rec["basis"] == "overlap" and abs(rec["overlap_stall_s"] - best) < 1e-9, (rec, best)
assert abs(s["op_s"] - 0.004 * steps / ops) < 1e-9 * s["op_s"], s["op_s"]
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
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 1G --op-ms 1 --step-s 1 >/dev/null 2>"$tmp/err" && fail "--op-ms with --step-s accepted"
grep -q "not both" "$tmp/err" || fail "--op-ms with --step-s: $(cat "$tmp/err")"
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 1G --op-ms -1 >/dev/null 2>"$tmp/err" && fail "negative --op-ms accepted"
./tier-tune "$tmp/t.trc" --hbm 8M --ddr 1G --window 2x >/dev/null 2>"$tmp/err" && fail "bad --window accepted"
grep -q -- "--window needs" "$tmp/err" || fail "bad --window: $(cat "$tmp/err")"
./tier-tune "$tmp/t.trc" --hbm 64M --ddr 1G --total 1M >"$tmp/out" 2>&1 || fail "--total"
grep -q "no policy and split within" "$tmp/out" || fail "--total too small: $(cat "$tmp/out")"
echo "PASS"
