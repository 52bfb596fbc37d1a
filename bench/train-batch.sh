#!/usr/bin/env bash
# train-batch.sh - the trainer issue's (a) and (b) at a larger batch (more tokens per pass over the
# expert weights, which (b) must stream from DDR on every pass), plus one profiled step of (a):
# nsys's kernel summary when nsys is there, else TIER_PROFILE=1's exact parts.
# usage: bench/train-batch.sh BUILD_DIR OUT_DIR [STEPS [BATCH]]   (CACHE_HBM, default 40G)
set -u
b=${1:?build dir}; out=${2:?out dir}; steps=${3:-4}; batch=${4:-4}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
cfg=bench/configs/qwen3-30b-a3b.json
run=("$b/tier-run" "${job_args[@]}" --config "$cfg")
if command -v nsys >/dev/null; then
	step 200 prof-a nsys profile -o "$out/prof-a" --stats=true --force-overwrite true "${run[@]}" --batch 1 --steps 3 \
		--ddr 4G --op-cache all:hbm=48G
	rm -f "$out"/prof-a.nsys-rep "$out"/prof-a.sqlite
else
	TIER_PROFILE=1 step 200 prof-a "${run[@]}" --batch 1 --steps 3 --ddr 4G --op-cache all:hbm=48G
fi
step 300 train-a-b$batch "${run[@]}" --batch "$batch" --steps "$steps" --ddr 4G --op-cache "all:hbm=${CACHE_HBM:-40G}"
step 500 train-b-b$batch "${run[@]}" --batch "$batch" --steps "$steps" --hbm 24G --ddr 110G
for n in train-a-b$batch train-b-b$batch; do
	echo "== $n"; grep -E "^# (done|MFU|budgets|hbm|ddr|link|op cache|time by|prefetch)|^ +[0-9]+ |rror" "$out/$n.log" | tail -16
done
echo "== prof-a"; grep -E "cuda_gpu_kern_sum|Time \(%\)|^ +[0-9.]+ +[0-9]" "$out/prof-a.log" | head -45
grep -E "^# time by" "$out/prof-a.log"
cat "$sum"
