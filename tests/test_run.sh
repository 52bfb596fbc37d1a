#!/bin/sh
# test_run.sh - tier-run's training job end to end: a short run writes a PEFT adapter and a log,
# the same seed gives the same losses, a small HBM budget gives the same losses as a large one, and
# bad input (device, data, output directory, budgets, job file) fails with exit 1 and a message.
# Run from the build directory (make check does).
set -u
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
[ -x ./tier-run ] || fail "./tier-run is not built (run make first)"
src=${TIER_TEST_SRCDIR:-..}
small="--data $src/data/corpus.txt --steps 4 --batch 2 --seq 16 --seed 5"

echo "# a short job writes an adapter and a log"
./tier-run $small --out "$tmp/out" >"$tmp/a.out" 2>"$tmp/a.err" || { cat "$tmp/a.err"; fail "tier-run exited $?"; }
cat "$tmp/a.out"
[ -s "$tmp/out/adapter_config.json" ] && [ -s "$tmp/out/adapter_model.safetensors" ] || fail "no adapter in --out"
[ "$(wc -l <"$tmp/out/train_log.jsonl")" = 4 ] || fail "train_log.jsonl should have 4 lines"
# each line: JSON whose time by part (pin aside: it overlaps the others) adds up to at most the step
python3 - "$tmp/out/train_log.jsonl" <<'PY' || fail "train_log.jsonl: bad time by part"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    parts = sum(v for k, v in r["ns_part"].items() if k != "pin")
    assert 0 < parts <= r["ns"], (parts, r["ns"])
    assert r["mfu"] is None and r["tokens_per_s"] > 0
PY
grep -q '"lora_alpha": *16' "$tmp/out/adapter_config.json" || fail "adapter_config.json lacks lora_alpha 16"
grep -q '^# done: 4 steps' "$tmp/a.out" || fail "no summary line"
grep -q 'hbm (emulated)' "$tmp/a.out" || fail "the summary does not name the emulated hbm tier"

echo "# determinism, and a budget smaller than the model changes nothing"
./tier-run $small --quiet --out "$tmp/b" >/dev/null 2>&1 || fail "second run failed"
cmp -s "$tmp/out/adapter_model.safetensors" "$tmp/b/adapter_model.safetensors" || fail "same seed, different adapter"
./tier-run $small --hbm 256M --out "$tmp/c" >"$tmp/c.out" 2>&1 || fail "unbounded run failed"
losses() { sed -n 's/^ *\([0-9][0-9]*\) *\([0-9.]*\) .*/\1 \2/p' "$1"; }
[ -n "$(losses "$tmp/a.out")" ] && [ "$(losses "$tmp/a.out")" = "$(losses "$tmp/c.out")" ] ||
	fail "the 14M and 256M budgets gave different losses"

echo "# kill -9 during a run, resume: the adapter equals an uninterrupted run's"
long="--data $src/data/corpus.txt --steps 40 --batch 1 --seq 16 --seed 9 --quiet"
./tier-run $long --out "$tmp/u" >/dev/null 2>&1 || fail "uninterrupted run failed"
./tier-run $long --out "$tmp/k" --checkpoint-every 1 >/dev/null 2>&1 &
pid=$!
i=0
while [ ! -f "$tmp/k/checkpoint.safetensors" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i + 1)); done
kill -9 $pid 2>/dev/null
wait $pid
rm -f "/dev/shm/tier-stats.$pid" # a killed job leaves its stats segment (tier-stat says so); not ours to keep
[ -f "$tmp/k/checkpoint.safetensors" ] || fail "no checkpoint written"
./tier-run $long --out "$tmp/k" --resume "$tmp/k/checkpoint.safetensors" >/dev/null 2>"$tmp/err" ||
	fail "resume failed: $(cat "$tmp/err")"
cmp -s "$tmp/u/adapter_model.safetensors" "$tmp/k/adapter_model.safetensors" || fail "resumed run differs"
expect_resume_bad() {
	./tier-run $long --lora-r 4 --resume "$tmp/k/checkpoint.safetensors" >/dev/null 2>"$tmp/err"
	[ $? = 1 ] && grep -q "another size\|missing" "$tmp/err" || fail "a checkpoint of another rank was accepted"
}
expect_resume_bad

echo "# SIGTERM mid-run: the step ends, no adapter, exit 128+15; the log shows the steps as they ran"
./tier-run --data "$src/data/corpus.txt" --steps 100000 --batch 1 --seq 16 --out "$tmp/t" >"$tmp/t.out" 2>"$tmp/t.err" &
pid=$!
i=0 # stdout is a file: the step lines must arrive a line at a time, not at exit
while ! grep -q '^ *3 ' "$tmp/t.out" && [ $i -lt 1000 ]; do sleep 0.01; i=$((i + 1)); done
grep -q '^ *3 ' "$tmp/t.out" || { kill -9 $pid; fail "no step line in the log within 10 s (stdout not line-buffered?)"; }
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 143 ] || fail "SIGTERM: exit $rc, expected 143 ($(cat "$tmp/t.err"))"
grep -q "stopping at the end of this step" "$tmp/t.err" && grep -q "stopped by signal 15" "$tmp/t.err" ||
	fail "SIGTERM: message '$(cat "$tmp/t.err")'"
[ ! -e "$tmp/t/adapter_model.safetensors" ] || fail "SIGTERM: an adapter was written"

echo "# a job file, overridden by the command line"
printf '{"steps": 2, "batch": 1, "seq": 8, "lora-targets": "q,v", "rslora": true}\n' >"$tmp/job.json"
./tier-run "$tmp/job.json" --steps 3 --data "$src/data/corpus.txt" >"$tmp/j.out" 2>&1 || { cat "$tmp/j.out"; fail "job file run failed"; }
grep -q '^# done: 3 steps' "$tmp/j.out" || fail "the command line did not override the job file"
printf '{"stepz": 2}\n' >"$tmp/bad.json"
./tier-run "$tmp/bad.json" >/dev/null 2>"$tmp/err"; [ $? = 1 ] && grep -q stepz "$tmp/err" || fail "unknown key accepted"

echo "# bad input"
expect1() { # expect1 PATTERN ARGS...: exit 1 and PATTERN in the message
	pat=$1; shift
	./tier-run "$@" >/dev/null 2>"$tmp/err"; rc=$?
	[ $rc = 1 ] || fail "tier-run $* exited $rc, expected 1 ($(cat "$tmp/err"))"
	grep -q -- "$pat" "$tmp/err" || fail "tier-run $*: message '$(cat "$tmp/err")' lacks '$pat'"
}
printf 'tiny' >"$tmp/tiny.txt"
expect1 "shorter" --data "$tmp/tiny.txt" --steps 1
# without a GPU (CI), --device cuda is a clear error; with one it trains (tests/test_golden_cuda)
if ! ./tier-run --device cuda --steps 1 --quiet >/dev/null 2>"$tmp/err"; then
	grep -q "CUDA" "$tmp/err" || fail "--device cuda without a GPU: message '$(cat "$tmp/err")' lacks CUDA"
fi
expect1 "cpu or cuda" --device tpu
expect1 "raise --hbm" --hbm 1M $small
# a budget a hair above the step's need: refused mid-step (exit 2) with a budget to try
./tier-run --steps 3 --micro-batches 8 --layer-major --batch 4 --seq 256 --ddr 100M --hbm 40M >/dev/null 2>"$tmp/err"
rc=$?
[ $rc = 2 ] && grep -q "hint: .*pinned copies split the free space.*try --hbm 46.00 MiB" "$tmp/err" ||
	fail "--hbm 40M beside a need of ~39 MiB: exit $rc, message '$(cat "$tmp/err")'"
# the warning names the need (which moves with the layouts) and suggests the next MiB above 115% of it
w=$(sed -n 's/.*warning: the HBM budget 40.00 MiB is within 15% of what the step needs (\([0-9.]*\) MiB).*--hbm \([0-9.]*\) MiB.*/\1 \2/p' "$tmp/err")
[ -n "$w" ] && echo "$w" | awk '{ s = $1 * 1.15; exit !($1 > 34 && $1 < 40 && $2 >= s && $2 < s + 1) }' ||
	fail "no warning up front for --hbm 40M, or a wrong suggestion: '$(cat "$tmp/err")'"
! grep -q "within 15%" "$tmp/a.err" || fail "the default job (14M for ~10 MiB) was warned about its budget"
# room for one operation but not for everything the step keeps: refused before the weights are made
expect1 "raise --ddr or give --nvme" --micro-batches 8 --layer-major --batch 4 --seq 256 --hbm 42M --ddr 10M --steps 1
expect1 "not a writable directory" --out /proc/version $small
expect1 "lora-targets" --lora-targets q,zz $small
expect1 "not both" --model "$tmp" --init random
expect1 "config.json" --model "$tmp/nosuch"
expect1 "unknown\|unrecognized" --nosuch
expect1 "give one" --checkpoint-every 2 $small
expect1 "must divide" --moe-chunks 3 $small # 2 x 16 tokens
./tier-run $small --moe-chunks 4 --quiet >/dev/null 2>"$tmp/err" || fail "--moe-chunks 4: $(cat "$tmp/err")"
# layer-major micro-batches: the same adapter as the default order, bit for bit
./tier-run $small --micro-batches 2 --quiet --out "$tmp/mb" >/dev/null 2>"$tmp/err" || fail "--micro-batches 2: $(cat "$tmp/err")"
./tier-run $small --micro-batches 2 --layer-major --quiet --out "$tmp/lm" >/dev/null 2>"$tmp/err" || fail "--layer-major: $(cat "$tmp/err")"
cmp -s "$tmp/mb/adapter_model.safetensors" "$tmp/lm/adapter_model.safetensors" || fail "--layer-major changed the adapter"
# the optimizer in the next step's forward: the same adapter, with a checkpoint written on the way
expect1 "end or forward" --optimizer-at later $small
./tier-run $small --micro-batches 2 --optimizer-at forward --checkpoint-every 3 --quiet --out "$tmp/of" >/dev/null \
	2>"$tmp/err" || fail "--optimizer-at forward: $(cat "$tmp/err")"
! grep -q "AdamW runs at each step's end" "$tmp/err" || fail "--optimizer-at forward fell back: $(cat "$tmp/err")"
cmp -s "$tmp/mb/adapter_model.safetensors" "$tmp/of/adapter_model.safetensors" ||
	fail "--optimizer-at forward changed the adapter"
# its log: the 6 layers updated in the forwards of steps 2 and 3, none in the first step nor in the
# one after the checkpoint (its save ran them)
[ "$(sed -n 's/.*"updates_in_forward":\([0-9]*\)}$/\1/p' "$tmp/of/train_log.jsonl" | tr '\n' ' ')" = "0 6 6 0 " ] ||
	fail "--optimizer-at forward: updates_in_forward in train_log.jsonl: $(cat "$tmp/of/train_log.jsonl")"
# micro-batches whose weights do not fit the HBM budget: tier-run suggests --layer-major, not when given
./tier-run $small --steps 1 --micro-batches 2 --out "$tmp/h1" >"$tmp/hint.txt" 2>&1 || fail "--micro-batches 2: $(cat "$tmp/hint.txt")"
grep -q "^# hint: .*--layer-major fetches them once a step for all 2" "$tmp/hint.txt" || fail "no --layer-major hint"
./tier-run $small --steps 1 --micro-batches 2 --layer-major --out "$tmp/h2" >"$tmp/hint.txt" 2>&1 || fail "--layer-major: $(cat "$tmp/hint.txt")"
! grep -q "^# hint:" "$tmp/hint.txt" || fail "a --layer-major hint with --layer-major given"
# an output that cannot take the adapter at the end: the message says what survived and how to
# get the adapter from it; once fixed, resuming at the last step writes it
mkdir -p "$tmp/sq/adapter_model.safetensors"
./tier-run $small --checkpoint-every 2 --out "$tmp/sq" >/dev/null 2>"$tmp/err"
rc=$?
[ $rc = 1 ] && grep -q "checkpoint.safetensors holds the state after the last step.*--resume.*another --out" "$tmp/err" ||
	fail "adapter write refused: exit $rc, '$(cat "$tmp/err")'"
./tier-run $small --checkpoint-every 2 --out "$tmp/sq2" --resume "$tmp/sq/checkpoint.safetensors" >/dev/null 2>"$tmp/err" &&
	[ -s "$tmp/sq2/adapter_model.safetensors" ] && [ -s "$tmp/sq/train_log.jsonl" ] ||
	fail "resuming at the last step wrote no adapter, or lost the first run's log: $(cat "$tmp/err")"
# a disk that fills (a file size limit stands in for it): the file named, the way out said, no
# temporary left behind
(trap '' XFSZ; ulimit -f 64; exec ./tier-run $small --checkpoint-every 2 --out "$tmp/full") >/dev/null 2>"$tmp/err"
rc=$?
[ $rc != 0 ] && grep -q "writing $tmp/full/checkpoint.safetensors.*the disk is full or a file size limit" "$tmp/err" ||
	fail "a full disk: exit $rc, '$(cat "$tmp/err")'"
# shellcheck disable=SC2010 # the names are tier-run's own (no newlines)
! ls "$tmp/full" | grep -q "\.tmp\." || fail "a temporary file left behind: $(ls "$tmp/full")"
./tier-run --help | grep -q -- '--lora-targets' || fail "--help does not document --lora-targets"
./tier-run --store-demo --help | grep -q 'store demonstration' || fail "tier-run --store-demo is not reachable"
echo "PASS"
