#!/usr/bin/env bash
# codegen.sh - what ptxas made of one CUDA source, read on a machine without a GPU: each kernel's
# registers, spill bytes and stack frame, and the count of wgmma serialisation warnings (C7515:
# products ptxas could not keep asynchronous, which cost far more than a spill), compiled with the
# build's own nvcc and flags. With BASE (a git revision) the same source at BASE is compiled
# beside it and only the kernels whose figures differ are printed, base -> now. With SASS=1 and
# cuobjdump and nvdisasm on PATH (the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm as reference tooling) it also counts each kernel's local-memory
# instructions (LDL, STL) and those between its first and last HGMMA: a spill in the products'
# loop costs every k step, one in the epilogue or the tile claim once a tile.
# usage: bench/codegen.sh BUILD_DIR SOURCE.cu   (e.g. build-dev moe/moe_wgmma.cu: about 70 s,
# twice that with BASE; BASE=c6f6c3f shows eeee429's claim point taking the default gate/up
# kernel's spill from 12/8 to 20/20 bytes)
set -eu
b=${1:?build dir}; src=${2:?CUDA source, relative to the repository root}
root=$(git rev-parse --show-toplevel)
[ -f "$b/Makefile" ] || { echo "codegen.sh: $b/Makefile missing; pass a configured build directory" >&2; exit 2; }
[ -f "$root/$src" ] || { echo "codegen.sh: $root/$src missing; pass a .cu path relative to the repository root" >&2; exit 2; }
nvcc=$(sed -n 's/^NVCC = //p' "$b/Makefile"); flags=$(sed -n 's/^NVCCFLAGS = //p' "$b/Makefile")
[ -n "$nvcc" ] || { echo "codegen.sh: $b was configured without CUDA (no NVCC in its Makefile)" >&2; exit 2; }
tmp=$(mktemp -d) # the logs and objects; KEEP=1 leaves them there (and BASE's worktree: git worktree prune)
if [ -n "${KEEP:-}" ]; then
	trap 'echo "codegen.sh: kept $tmp"' EXIT
else
	trap 'git -C "$root" worktree remove --force "$tmp/base" 2>/dev/null; rm -rf "$tmp"' EXIT
fi
bdir=$(cd "$b" && pwd)

# compile TREE NAME: ptxas's report in $tmp/NAME.log, the object in $tmp/NAME.o
compile() {
	# shellcheck disable=SC2086 # the flags are separate words
	(cd "$1" && "$nvcc" $flags -std=c++17 -Iinclude -I. -I"$bdir" -DTIER_HAVE_CUDA=1 -Xptxas -v \
		-c "$src" -o "$tmp/$2.o") > "$tmp/$2.log" 2>&1 || { tail -n 20 "$tmp/$2.log" >&2; exit 1; }
}

# figures NAME: one line a kernel, "name regs spill-stores spill-loads stack", sorted by name
figures() {
	awk '/Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); k = substr($0, RSTART + 1, RLENGTH - 2) }
	     /bytes stack frame/ { st[k] = $1; ss[k] = $5; sl[k] = $9 } # N bytes stack frame, N bytes spill stores, N ...
	     /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") r[k] = $(i + 1) }
	     END { for (k in r) print k, r[k], ss[k] + 0, sl[k] + 0, st[k] + 0 }' "$tmp/$1.log" | sort
}

# sass NAME: one line a kernel, "name ldl+stl in-loop", from cuobjdump's disassembly
sass() {
	cuobjdump -sass "$tmp/$1.o" | awk '
		function out() { if (k != "") { n = 0; for (i = 1; i <= m; i++) n += (loc[i] > f && loc[i] < l); print k, m, n } }
		/Function : / { out(); k = $3; m = 0; f = 1e9; l = -1; line = 0; next }
		{ line++ }
		/HGMMA/ { if (line < f) f = line; l = line }
		/[^A-Z](LDL|STL)[. ]/ { loc[++m] = line }
		END { out() }' | sort
}

demangle() { if command -v c++filt > /dev/null; then c++filt; else cat; fi; }

compile "$root" now
figures now > "$tmp/now.txt"
echo "$src: $(wc -l < "$tmp/now.txt") kernels, C7515 (wgmma serialised) $(grep -c C7515 "$tmp/now.log" || true)"
if [ -n "${BASE:-}" ]; then
	git -C "$root" worktree add -q --detach "$tmp/base" "$BASE"
	compile "$tmp/base" base
	figures base > "$tmp/base.txt"
	echo "at $BASE: $(wc -l < "$tmp/base.txt") kernels, C7515 $(grep -c C7515 "$tmp/base.log" || true)"
	echo "kernels that changed (registers, spill stores/loads, stack bytes: base -> now):"
	join -a1 -a2 -e - -o 0,1.2,1.3,1.4,1.5,2.2,2.3,2.4,2.5 "$tmp/base.txt" "$tmp/now.txt" |
		awk '$2 != $6 || $3 != $7 || $4 != $8 || $5 != $9 {
			printf "  %s\n    regs %s -> %s, spill %s/%s -> %s/%s, stack %s -> %s\n", $1, $2, $6, $3, $4, $7, $8, $5, $9 }' |
		demangle
else
	echo "registers, spill stores/loads, stack bytes:"
	awk '{ printf "  %s\n    regs %s, spill %s/%s, stack %s\n", $1, $2, $3, $4, $5 }' "$tmp/now.txt" | demangle
fi
if [ "${SASS:-0}" = 1 ]; then
	if ! command -v cuobjdump > /dev/null || ! command -v nvdisasm > /dev/null; then
		echo "codegen.sh: SASS=1 needs cuobjdump and nvdisasm on PATH" >&2; exit 2
	fi
	echo "local-memory instructions (LDL/STL): all, and between the first and last HGMMA:"
	sass now | awk '$2 > 0 { printf "  %s\n    %s, %s in the products\n", $1, $2, $3 }' | demangle
fi
