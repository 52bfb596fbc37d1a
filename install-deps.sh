#!/bin/sh
# install-deps.sh - install what tier builds and tests with on Debian 12 (uses sudo unless root).
# CUDA is optional and not installed here: with nvcc under /usr/local/cuda, configure finds it.
set -e
if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends build-essential autoconf automake libtool \
  pkg-config libnuma-dev libhwloc-dev liburing-dev libjemalloc-dev libcmocka-dev libopenblas-dev \
  libjansson-dev libcairo2-dev valgrind fio bc >/dev/null
