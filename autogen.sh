#!/bin/sh
# autogen.sh - regenerate the build system (configure, Makefile.in) from configure.ac and Makefile.am
set -e
cd "$(dirname "$0")"
autoreconf -fi
