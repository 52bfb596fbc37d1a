#!/usr/bin/env bash
# train-session.sh - the trainer on the GPU in one call: its CUDA tests (the small kernels, the
# golden model against HF in bf16), then the Qwen3-30B-A3B-shaped benchmark of the trainer issue:
# (a) no HBM cap, (b) --hbm 24G with the rest in DDR, (c) HF transformers + PEFT on the same shape
# in the same run. Logs under OUT; a short table last.
# usage: bench/train-session.sh BUILD_DIR OUT_DIR [STEPS [BATCH]] (STAGES=tests,a,b,c by default)
set -u
b=${1:?build dir}; out=${2:?out dir}; steps=${3:-6}; batch=${4:-1}; mkdir -p "$out"
stages=${STAGES:-tests,a,b,c}
# shellcheck source-path=SCRIPTDIR source=session-lib.sh
. "$(dirname "$0")/session-lib.sh"
has() { case ",$stages," in *",$1,"*) return 0;; esac; return 1; }
if has tests; then
	for t in test_ops_cuda test_golden_cuda test_loss_cuda test_attn_cuda test_moe_cuda; do
		step 120 "$t" "$b/tests/$t"
	done
	# the default job's model on the GPU with LoRA dropout (attention targets): the loss must fall
	step 120 dropout-cuda "$b/tier-run" --device cuda --lora-dropout 0.1 --lora-targets q,k,v,o --steps 40 \
		--out "$out/dropout-cuda"
fi
cfg=bench/configs/qwen3-30b-a3b.json
run=("$b/tier-run" "${job_args[@]}" --config "$cfg" --batch "$batch" --steps "$steps")
has a && step 400 train-a "${run[@]}" --ddr 4G
has a && step 400 train-a-cache "${run[@]}" --ddr 4G --op-cache "all:hbm=${CACHE_HBM:-48G}"
has b && step 500 train-b "${run[@]}" --hbm 24G --ddr 110G
has b && step 500 train-b-cache "${run[@]}" --hbm 24G --ddr 110G --op-cache "all:hbm=${CACHE_HBM_B:-6G}:ddr=32G"
if has c; then
	step 400 torch-attn python3 bench/train_torch.py --targets attn --seq 4096 --steps 4 --warmup 2
	step 400 torch-experts python3 bench/train_torch.py --targets attn+experts --gradient-checkpointing --seq 4096 --steps 4 --warmup 2
fi
for n in dropout-cuda train-a train-a-cache train-b train-b-cache; do
	[ -f "$out/$n.log" ] && { echo "== $n"; grep -E "^# (done|MFU|hbm|ddr|link|op cache|time by)|^ +[0-9]+ |rror" "$out/$n.log" | tail -14; }
done
for n in torch-attn torch-experts; do [ -f "$out/$n.log" ] && { echo "== $n"; grep '^{' "$out/$n.log"; }; done
cat "$sum"
