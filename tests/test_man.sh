#!/bin/sh
# test_man.sh - every option a tool's --help lists is documented in its man page (man/TOOL.1), so
# that the two cannot drift apart. Run from the build directory (make check does).
set -u
src=${TIER_TEST_SRCDIR:-..}
fail() { echo "FAIL: $*"; exit 1; }
for t in tier-run tier-plan tier-stat tier-tune; do
	[ -x "./$t" ] || fail "./$t is not built (run make first)"
	[ -f "$src/man/$t.1" ] || fail "$src/man/$t.1 is missing"
	help=$("./$t" --help 2>&1) || true
	opts=$(printf '%s\n' "$help" | grep -o -- '--[a-z][a-z0-9-]*' | sort -u)
	[ -n "$opts" ] || fail "$t --help lists no options"
	page=$(sed 's/\\-/-/g' "$src/man/$t.1") # roff writes a dash as \-
	n=0
	for o in $opts; do
		[ "$o" = --help ] && continue
		printf '%s\n' "$page" | grep -q -- "$o\([^a-z0-9-]\|$\)" || fail "$t: $o is in --help but not in man/$t.1"
		n=$((n + 1))
	done
	echo "# $t: $n options, each in man/$t.1"
done
echo PASS
