#!/usr/bin/env bash
# final-session.sh - one GPU call that checks a build end to end: the CUDA tests of the trainer's
# kernels, the attention variants against torch SDPA (TIER_ATTN_FWD / TIER_ATTN_BWD), then the
# trainer issue's runs: (a) batch 1 and 4 with the op cache, (b) --hbm 24G at batch 8, 12 and 16 (the
# larger two with the MoE half in 4 token chunks, --moe-chunks) and 4 layer-major micro-batches of
# 8 (--layer-major), and (c) HF +
# PEFT with LoRA on attention and experts. Should a new attention kernel fail its test, the
# trainer runs fall back to v1. usage: bench/final-session.sh BUILD_DIR OUT_DIR
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
for t in test_attn_cuda test_ops_cuda test_golden_cuda test_moe_cuda test_moe_skinny test_moe_wgmma test_offload_cuda; do
	step 120 "$t" "$b/tests/$t"
done
grep -q '^test_attn_cuda  *rc=0 ' "$sum" || export TIER_ATTN_FWD=v1 TIER_ATTN_BWD=v1
for f in v1 v2 w8; do TIER_ATTN_FWD=$f TIER_ATTN_BWD=v1 step 60 "attn-f$f" "$b/tier-bench" attn --json; done
for k in v2 k128 q64; do TIER_ATTN_BWD=$k step 60 "attn-b$k" "$b/tier-bench" attn --json; done
step 90 attn-torch python3 bench/attn_torch.py --tier "$out/attn-bq64.log" # the default pair: v2 + q64
cfg=bench/configs/qwen3-30b-a3b.json
run=("$b/tier-run" "${job_args[@]}" --config "$cfg")
step 120 train-a1 "${run[@]}" --batch 1 --steps 5 --ddr 4G --op-cache all:hbm=48G
step 150 train-a4 "${run[@]}" --batch 4 --steps 4 --ddr 4G --op-cache all:hbm=40G
step 200 train-b8 "${run[@]}" --batch 8 --steps 4 --hbm 24G --ddr 110G
# larger batches under the same cap, the MoE half in token chunks (a smaller scratch)
step 240 train-b16c4 "${run[@]}" --batch 16 --moe-chunks 4 --steps 3 --hbm 24G --ddr 110G
step 200 train-b12c4 "${run[@]}" --batch 12 --moe-chunks 4 --steps 3 --hbm 24G --ddr 110G
# 4 micro-batches of 8, layer-major: each layer's weights cross once a step for 4 x 32768 tokens
step 300 train-b8x4lm "${run[@]}" --batch 8 --micro-batches 4 --layer-major --steps 3 --hbm 24G --ddr 110G
step 150 torch-experts python3 bench/train_torch.py --targets attn+experts --gradient-checkpointing --seq 4096 --batch 8 \
	--steps 4 --warmup 2
for f in "$out"/attn-*.log; do echo "== $f"; grep -v '^{' "$f" | grep -E "fwd|bwd" | head -6; done
for n in train-a1 train-a4 train-b8 train-b16c4 train-b12c4 train-b8x4lm; do
	echo "== $n"; grep -E "^# (budgets|done|MFU|hbm|link|op cache|prefetch|pinning)|^ +[0-9]+ |rror" "$out/$n.log" | tail -14
done
echo "== torch-experts"; grep '^{' "$out/torch-experts.log"
cat "$sum"
