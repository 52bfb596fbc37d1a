#!/usr/bin/env bash
# kprof-session.sh - where the GPU time goes at full clocks, through the CUPTI activity profiler
# (tools/kprof.c, loaded by CUDA_INJECTION64_PATH; no replay, every launch of the run): the
# trainer's (a) job on the 48-layer Qwen3-30B-A3B shape (3 steps, step 1's warm-up included), then
# tier-bench attn and moe. bench/train-kernels.sh is the ncu counterpart (one step of a 2-layer
# model, each kernel alone at ncu's base clocks). Tables in OUT/kprof-*.txt.
# usage: bench/kprof-session.sh BUILD_DIR OUT_DIR   (libcupti.so.13 on LD_LIBRARY_PATH or the rpath)
set -u
b=${1:?build dir}; out=${2:?out dir}; mkdir -p "$out"
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
lib=$(cd "$b" && pwd)/tools/libtier-kprof.so
[ -f "$lib" ] || { echo "kprof-session: no $lib (a CUDA build makes it)"; exit 2; }
prof() { echo env CUDA_INJECTION64_PATH="$lib" TIER_KPROF_OUT="$out/kprof-$1.txt" TIER_KPROF_TOP=60; }
# shellcheck disable=SC2046 # prof's words are env and its assignments
step 120 train-a1 $(prof train-a1) "$b/tier-run" "${job_args[@]}" --config bench/configs/qwen3-30b-a3b.json \
	--batch 1 --steps 3 --ddr 4G --op-cache all:hbm=48G
# shellcheck disable=SC2046
step 60 attn $(prof attn) "$b/tier-bench" attn
# shellcheck disable=SC2046
step 60 moe $(prof moe) "$b/tier-bench" moe --model qwen3-30b --warmup-ms 200
head -40 "$out"/kprof-*.txt
cat "$sum"
