#!/bin/sh
# test_man.sh - every option a tool's --help lists has an entry (a .TP heading) in its man page
# (man/TOOL.1), so that the two cannot drift apart. Run from the build directory (make check does).
set -u
src=${TIER_TEST_SRCDIR:-..}
fail() { echo "FAIL: $*"; exit 1; }
for t in tier-run tier-plan tier-stat tier-tune; do
	[ -x "./$t" ] || fail "./$t is not built (run make first)"
	[ -f "$src/man/$t.1" ] || fail "$src/man/$t.1 is missing"
	help=$("./$t" --help 2>&1) || true
	# the options a line of --help defines: its option column ("  -p, --pid PID", "  --seq N, --mbs N"),
	# not the options its description mentions
	opts=$(printf '%s\n' "$help" | grep -E -- '^ +(-[a-zA-Z], )?--[a-z]' | sed -E 's/^ +//; s/ {2,}.*//' |
		grep -oE -- '--[a-z][a-z0-9-]*' | sort -u)
	[ -n "$opts" ] || fail "$t --help lists no options"
	# an option's heading: the line after .TP (roff writes a dash as \-); the SYNOPSIS does not count
	heads=$(sed 's/\\-/-/g' "$src/man/$t.1" | awk 'prev == ".TP" { print } { prev = $0 }')
	n=0
	for o in $opts; do
		[ "$o" = --help ] && continue
		printf '%s\n' "$heads" | grep -Eq -- "$o([^a-z0-9-]|\$)" ||
			fail "$t: $o is in --help but has no .TP heading in man/$t.1"
		n=$((n + 1))
	done
	echo "# $t: $n options, each in man/$t.1"
done
echo PASS
