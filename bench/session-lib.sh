# shellcheck shell=bash # sourced by the bash session scripts
# session-lib.sh - what the GPU session scripts share (sourced, with $out set): step runs one
# command under a time limit, its output in $logs/NAME.log and a line in $out/summary.txt, so that
# one hang cannot eat the lease; the GPU's name goes to $out/gpu.txt.
export TIER_TEST_SRCDIR=$PWD
# shellcheck disable=SC2154 # out: set by the script that sources this
sum="$out/summary.txt"; : > "$sum"
# LOGS_DIR: where the steps' logs go (default $out); elsewhere, each step also rewrites
# $out/logs.tgz from it, so that a run cut off by its time limit still returns every finished
# step's log in one file (the device returns only a few files from $out)
logs=${LOGS_DIR:-$out}; mkdir -p "$logs"
step() { # limit name command...
	local lim=$1 name=$2; shift 2
	local t0=$SECONDS
	# -k: a job that outlives its SIGTERM by 15 s (tier-run finishes its step first) is killed
	timeout -k 15 "$lim" "$@" > "$logs/$name.log" 2>&1; local rc=$?
	[ "$logs" = "$out" ] || tar czf "$out/logs.tgz" -C "$logs" .
	printf '%-22s rc=%-3d %4ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$sum"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# read_variants DEFAULT: the array vars from VARIANTS (else DEFAULT), split at ';', each element
# one form's settings; "" is the defaults, also where the list ends in ';' (read drops that field)
read_variants() {
	local v=${VARIANTS:-$1}
	IFS=';' read -r -a vars <<< "$v"
	[[ $v == *';' ]] && vars+=("")
	[ ${#vars[@]} -gt 0 ] || vars=("")
}
# The trainer issue's benchmark job on the GPU (synthetic bf16 weights, sequence 4096, LoRA r 16 on
# attention and experts); scripts add --config, batch, steps and budgets.
# shellcheck disable=SC2034,SC2054 # read by the scripts that source this; the commas are one option's list
job_args=(--device cuda --init random --init-range 0.02 --seq 4096 --warmup 1 --lr 1e-4
	  --lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,experts)
