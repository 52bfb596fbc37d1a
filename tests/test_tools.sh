#!/bin/sh
# test_tools.sh - tier-run, tier-stat and tier-bench end to end: a demo job watched live, the
# documented exit codes, a clean stop on SIGTERM, and the store benchmark.
# Run from the build directory (make check does); the programs are ./tier-run etc.
set -u
tmp=$(mktemp -d) || exit 99
run_pid=
cleanup() { [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
for p in tier-run tier-stat tier-bench; do
	[ -x "./$p" ] || fail "./$p is not built (run make first)"
done

# Wait until process $1 publishes its statistics (tier-stat with no interval prints one row).
wait_published() {
	i=0
	until ./tier-stat -p "$1" >/dev/null 2>&1; do
		i=$((i + 1))
		[ $i -lt 100 ] || fail "process $1 never published statistics"
		kill -0 "$1" 2>/dev/null || fail "process $1 exited before publishing"
		sleep 0.1
	done
}

echo "# a long demo job, watched live"
mkdir "$tmp/nvme"
./tier-run --store-demo --hbm 8M --ddr 24M --nvme "$tmp/nvme:64M" --steps 100000 --policy lfu --seed 7 \
	>"$tmp/run.out" 2>"$tmp/run.err" &
run_pid=$!
wait_published $run_pid
./tier-stat -p $run_pid 0.2 3 >"$tmp/stat.out"; rc=$?
cat "$tmp/stat.out"
[ $rc = 0 ] || fail "tier-stat -p PID 0.2 3 exited $rc"
rows=$(grep -c '^[0-9][0-9]:[0-9][0-9]:[0-9][0-9] ' "$tmp/stat.out")
[ "$rows" = 3 ] || fail "expected 3 rows, got $rows"
grep -q 'hbm (emulated)' "$tmp/stat.out" || fail "the header does not name the emulated hbm tier"
# Figures change between rows (the step column at least), the time aside.
first=$(grep '^[0-9][0-9]:' "$tmp/stat.out" | head -1 | cut -c9-)
last=$(grep '^[0-9][0-9]:' "$tmp/stat.out" | tail -1 | cut -c9-)
[ "$first" != "$last" ] || fail "figures did not change between rows"
./tier-stat -p $run_pid --json 0.2 2 >"$tmp/stat.json" || fail "tier-stat --json failed"
[ "$(grep -c '^{"time":.*"tiers":\[.*"links":\[.*"prefetch":{' "$tmp/stat.json")" = 2 ] ||
	fail "tier-stat --json did not print 2 JSON objects"
if command -v python3 >/dev/null; then
	python3 -c 'import json,sys; [json.loads(l) for l in open(sys.argv[1])]' "$tmp/stat.json" ||
		fail "tier-stat --json printed invalid JSON"
fi

echo "# SIGTERM stops the job cleanly"
kill -TERM $run_pid
wait $run_pid; rc=$?
run_pid=
[ $rc = 143 ] || { cat "$tmp/run.err"; fail "tier-run exited $rc on SIGTERM, expected 143"; }
head -1 "$tmp/run.out" | grep -q 'store demonstration' || fail "first line does not say what tier-run is"
[ -z "$(ls -A "$tmp/nvme")" ] || fail "tier-run left files in its NVMe directory: $(ls "$tmp/nvme")"
./tier-stat -p "$(sed -n 's/^# pid \([0-9]*\),.*/\1/p' "$tmp/run.out")" 2>/dev/null; rc=$?
[ $rc = 2 ] || fail "tier-stat on the stopped job exited $rc, expected 2"

echo "# exit codes"
dead=999999
while kill -0 $dead 2>/dev/null; do dead=$((dead + 1)); done
./tier-stat -p $dead 2>"$tmp/err"; rc=$?
[ $rc = 2 ] || fail "tier-stat -p $dead exited $rc, expected 2"
grep -q "no process $dead" "$tmp/err" || fail "tier-stat -p $dead: $(cat "$tmp/err")"
if [ ! -e "/dev/shm/tier-stats.$$" ]; then # else an earlier job with this shell's pid left one behind
	./tier-stat -p $$ 2>"$tmp/err"; rc=$?
	[ $rc = 2 ] || fail "tier-stat on a process without statistics exited $rc, expected 2"
	grep -q "publishes no tier statistics" "$tmp/err" || fail "$(cat "$tmp/err")"
fi
if command -v python3 >/dev/null && [ -d /dev/shm ]; then
	# A segment of another version (as a job of another build would publish) is refused with 3.
	sleep 30 & other=$!
	python3 -c 'import struct,sys; open(sys.argv[1],"wb").write(struct.pack("<QII",0x5441545352454954,99,1600)+bytes(1584))' \
		"/dev/shm/tier-stats.$other"
	./tier-stat -p $other 2>"$tmp/err"; rc=$?
	rm -f "/dev/shm/tier-stats.$other"; kill $other
	[ $rc = 3 ] || fail "tier-stat on a version-99 segment exited $rc, expected 3 ($(cat "$tmp/err"))"
	grep -q "version 99, this tier-stat reads version [0-9]" "$tmp/err" || fail "$(cat "$tmp/err")"
fi
./tier-stat 2>/dev/null; [ $? = 1 ] || fail "tier-stat without -p should exit 1"
./tier-stat -p 1 0 2>/dev/null; [ $? = 1 ] || fail "tier-stat INTERVAL 0 should exit 1"
./tier-stat --run "$tmp" 2>"$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q "tier-stat report" "$tmp/err" || fail "tier-stat --run without tier.pid exited $rc: $(cat "$tmp/err")"
./tier-stat --help | grep -q -- '--json' || fail "tier-stat --help does not cover --json"
./tier-run --steps 0 2>/dev/null; [ $? = 1 ] || fail "tier-run --steps 0 should exit 1"
./tier-run --policy nosuch 2>/dev/null; [ $? = 1 ] || fail "tier-run --policy nosuch should exit 1"

echo "# a job that exits while watched"
# (a job that runs until stopped, so that it cannot finish before tier-stat is attached: with a
# fixed step count a fast machine ended it first, and tier-stat rightly said there was no job)
./tier-run --store-demo --hbm 4M --ddr 12M --nvme "$tmp/nvme:32M" --steps 100000 --policy lru >/dev/null 2>&1 &
run_pid=$!
wait_published $run_pid
./tier-stat -p $run_pid 0.05 >/dev/null 2>"$tmp/err" &
stat_pid=$!
sleep 1
kill -TERM $run_pid
wait $stat_pid; rc=$?
wait $run_pid
run_pid=
[ $rc = 4 ] || fail "tier-stat on an exiting job exited $rc, expected 4 ($(cat "$tmp/err"))"
grep -q "exited" "$tmp/err" || fail "$(cat "$tmp/err")"

echo "# the whole demonstration, small"
./tier-run --store-demo --hbm 4M --ddr 12M --nvme "$tmp/nvme:32M" --steps 2 --seed 3 >"$tmp/demo.out" || fail "tier-run failed"
cat "$tmp/demo.out"
for p in lru lfu cost schedule; do
	grep -q "^$p " "$tmp/demo.out" || fail "no row for policy $p"
done
grep -q '^tiers: hbm (emulated)' "$tmp/demo.out" || fail "no tiers line naming hbm (emulated)"

echo "# tier-bench"
./tier-bench --help >"$tmp/help" || fail "tier-bench --help failed"
grep -q '^  store ' "$tmp/help" || fail "tier-bench --help does not list store"
./tier-bench nosuch 2>/dev/null; [ $? = 1 ] || fail "tier-bench nosuch should exit 1"
./tier-bench store --hbm 16M --ddr 16M --nvme "$tmp/nvme:16M" --iters 3 >"$tmp/bench.out" || fail "tier-bench store failed"
cat "$tmp/bench.out"
[ "$(grep -c '^  *miss ' "$tmp/bench.out")" -ge 6 ] || fail "tier-bench store printed too few miss rows"
grep -q '^# summary:' "$tmp/bench.out" || fail "tier-bench store printed no summary"
./tier-bench sched --layers 8 --per-op 40 --iters 2 >"$tmp/sched.out" || fail "tier-bench sched failed"
cat "$tmp/sched.out"
[ "$(grep -Ec '^ +[0-9]+ +[0-9]+ +2 ' "$tmp/sched.out")" = 3 ] || fail "tier-bench sched printed not 3 rows"
grep -Eq '^# summary: announcing an operation costs at most [0-9.]+x' "$tmp/sched.out" ||
	fail "tier-bench sched printed no summary"
./tier-bench sched --layers 0 2>/dev/null; [ $? = 1 ] || fail "tier-bench sched --layers 0 should exit 1"
./tier-bench sched --bogus 2>/dev/null; [ $? = 1 ] || fail "tier-bench sched --bogus should exit 1"
# the MoE block on the CPU reference: every row but the Hopper products' (gate-up, down: GPU only),
# after warm-up runs of at least 5 ms each; a malformed --warmup-ms is refused
./tier-bench moe --device cpu --shape 24,16,8,4,2 --routing uniform --iters 2 --warmup-ms 5 --json \
	>"$tmp/moe.out" || fail "tier-bench moe --device cpu failed"
grep -q 'after 5 ms of warm-up' "$tmp/moe.out" || fail "tier-bench moe did not say its warm-up"
grep -q ' experts-fwd ' "$tmp/moe.out" || fail "tier-bench moe printed no experts-fwd row"
# 48 rows over 4 experts, so every group holds 64 rows or fewer: 128 rows multiplied for each of
# the u experts with rows (1-4), 64 with idle consumers
pad=$(sed -n 's/.*uniform: 128-row tiles multiply \([0-9.]*\)x the 48 rows of the groups (\([0-9.]*\)x with idle.*/\1 \2/p' "$tmp/moe.out")
echo "$pad" | awk '{ u = $1 * 48 / 128; exit !(NF == 2 && u > 0.99 && u < 4.01 && (u - int(u + 0.5))^2 < 1e-3 && ($1 - 2 * $2)^2 < 1e-3) }' ||
	fail "tier-bench moe's padding line is missing or wrong: '$pad'"
if grep -q ' gate-up ' "$tmp/moe.out"; then fail "tier-bench moe timed gate-up on the CPU"; fi
grep -q '"gate_up_ms":0.0000' "$tmp/moe.out" || fail "tier-bench moe's JSON should mark gate-up not run"
./tier-bench moe --device cpu --warmup-ms soon 2>/dev/null; [ $? = 1 ] || fail "tier-bench moe --warmup-ms soon should exit 1"
# the fused steps are CUDA kernels: without a device it says so (exit 2); bad options exit 1
./tier-bench fused --tokens 0 2>"$tmp/fz.err"; [ $? = 1 ] || fail "tier-bench fused --tokens 0 should exit 1"
grep -q 'tokens' "$tmp/fz.err" || fail "tier-bench fused --tokens 0: no message naming the option"
if ! ./tier-bench fused --help | grep -q -- '--iters'; then fail "tier-bench fused --help lists no options"; fi
if [ ! -e /dev/nvidia0 ]; then
	./tier-bench fused --iters 1 >/dev/null 2>"$tmp/fz.err"; [ $? = 2 ] || fail "tier-bench fused without a GPU should exit 2"
	grep -qi 'cuda' "$tmp/fz.err" || fail "tier-bench fused without a GPU: no message saying why"
fi
# the experts' LoRA kernels likewise
./tier-bench lora --layers x 2>"$tmp/lz.err"; [ $? = 1 ] || fail "tier-bench lora --layers x should exit 1"
grep -q 'layers' "$tmp/lz.err" || fail "tier-bench lora --layers x: no message naming the option"
if ! ./tier-bench lora --help | grep -q -- '--tokens'; then fail "tier-bench lora --help lists no options"; fi
if [ ! -e /dev/nvidia0 ]; then
	./tier-bench lora --iters 1 >/dev/null 2>"$tmp/lz.err"; [ $? = 2 ] || fail "tier-bench lora without a GPU should exit 2"
	grep -qi 'cuda' "$tmp/lz.err" || fail "tier-bench lora without a GPU: no message saying why"
fi
echo "PASS"
