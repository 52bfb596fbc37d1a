#!/bin/sh
# test_plan.sh - tier-plan end to end: the report's sections, --json that parses, --smallest, the
# documented exit codes (0 fits, 1 does not, 2 bad input) and the error messages.
# Run from the build directory (make check does); the program is ./tier-plan.
set -u
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
[ -x ./tier-plan ] || fail "./tier-plan is not built (run make first)"

# expect CODE ARGS...: run tier-plan, check its exit code; output in $tmp/out, $tmp/err
expect() {
	want=$1
	shift
	./tier-plan "$@" >"$tmp/out" 2>"$tmp/err"
	got=$?
	[ "$got" -eq "$want" ] || fail "tier-plan $* exited $got, want $want: $(cat "$tmp/err")"
}

echo "# the seeds' case on 128 H200: fits, with every section"
expect 0 seed-2.8t seed-128
for s in "# parameters by component" "# bytes per GPU by tier" "# fits: yes" "<- bottleneck" "# summary: step"; do
	grep -q -- "$s" "$tmp/out" || fail "report lacks '$s'"
done
grep -q "^ routed experts *2.7622e+12" "$tmp/out" || fail "routed experts count"

echo "# --json parses and agrees"
expect 0 seed-2.8t seed-128 --json
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["gpus"] == 128 and d["fits"] is True \
	and d["params"]["total"] == 2779500174336, d' "$tmp/out" 2>"$tmp/err" || \
	{ command -v python3 >/dev/null && fail "json: $(cat "$tmp/err")"; }

echo "# 4 layer-major micro-batches a step: in the report and the JSON, 4 times the tokens"
expect 0 qwen3-30b-a3b h200-8x --gpus-per-node 1 --seq 4096 --mbs 8 --accum 4 --layer-major --json
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["accum"] == 4 and d["layer_major"] is True \
	and abs(d["tokens_per_s"] * d["step_s"] / (4 * 8 * 4096) - 1) < 1e-4, d' "$tmp/out" 2>"$tmp/err" || \
	{ command -v python3 >/dev/null && fail "json, accum: $(cat "$tmp/err")"; }
expect 0 qwen3-30b-a3b h200-8x --gpus-per-node 1 --seq 4096 --mbs 8 --accum 4 --layer-major
grep -q "micro-batch 8 x 4 a step (layer-major)" "$tmp/out" || fail "layout line lacks the micro-batches"
grep -q "# step time (4 micro-batches, layer-major" "$tmp/out" || fail "time table lacks the micro-batches"

echo "# --smallest, and HBM only"
expect 0 seed-2.8t h200-8x --smallest
grep -q "1 node x 8 GPUs = 8 GPUs (the smallest that fits)" "$tmp/out" || fail "smallest: $(head -1 "$tmp/out")"
expect 1 seed-2.8t h200-8x --smallest --no-tiering --max-nodes 8
grep -q "no cluster of up to 8 h200-8x nodes fits" "$tmp/err" || fail "no-fit message: $(cat "$tmp/err")"
expect 1 deepseek-v3 h100-8x --no-tiering --nodes 1
grep -q "# fits: NO" "$tmp/out" || fail "no-fit report"

echo "# bad input: exit 2 with a message"
expect 2 gpt-5 h200-8x
grep -q "seed-2.8t" "$tmp/err" || fail "unknown model message lists no presets"
expect 2 seed-2.8t tpu
grep -q "h200-8x" "$tmp/err" || fail "unknown cluster message lists no presets"
expect 2 seed-2.8t h200-8x --ep 3
expect 2 seed-2.8t h200-8x --seq 0
expect 2 seed-2.8t h200-8x --accum 0
grep -q "accum" "$tmp/err" || fail "--accum 0 message: $(cat "$tmp/err")"
expect 2 seed-2.8t h200-8x --hbm-reserve lots
expect 2 seed-2.8t h200-8x --lora-targets q,kv
expect 2 seed-2.8t h200-8x --mfu 2
expect 2 seed-2.8t h200-8x --calibrate "$tmp/missing"
expect 2 seed-2.8t
echo "PASS"
