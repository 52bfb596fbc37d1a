#!/usr/bin/env bash
# trainer-set.sh - the trainer issue's three figures in one GPU call, as measured on 2026-12-02
# (bench/RESULTS.md, session 7, call 3): (b) --hbm 24G with 4 layer-major micro-batches of 8 (and
# 2 of 16 in 4 MoE chunks), (a) uncapped at batch 1 with the op cache and at batch 16 in 4 chunks,
# (c) HF transformers + PEFT on the same shape at its largest batch. About 7 minutes on one H200.
# Logs under OUT; each run's per-step lines and summary last.
# usage: bench/trainer-set.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
run=("$b/tier-run" "${job_args[@]}" --config bench/configs/qwen3-30b-a3b.json)
step 170 train-b8x4lm "${run[@]}" --batch 8 --micro-batches 4 --layer-major --steps 5 --hbm 24G --ddr 110G
step 70 train-a16c4 "${run[@]}" --batch 16 --moe-chunks 4 --steps 5 --ddr 4G
step 45 train-a1 "${run[@]}" --batch 1 --steps 6 --ddr 4G --op-cache all:hbm=48G
step 80 torch-experts python3 bench/train_torch.py --targets attn+experts --gradient-checkpointing --seq 4096 \
	--batch 8 --steps 4 --warmup 2
step 150 train-b16x2lm "${run[@]}" --batch 16 --moe-chunks 4 --micro-batches 2 --layer-major --steps 4 --hbm 24G \
	--ddr 110G
for n in train-b8x4lm train-b16x2lm train-a1 train-a16c4; do
	echo "== $n"; grep -E "^# (budgets|done|time|pinning)|^ +[0-9]+ |rror" "$out/$n.log"
done
echo "== torch-experts"; grep '^{' "$out/torch-experts.log"
cat "$sum"
