#!/usr/bin/env bash
# Installs what zeroshard needs on a bare Debian machine, then builds it in place
# (pip install --no-build-isolation -e ., one CMake build in ./build for Python, tests and
# examples). Running it again only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}

# System packages: header-only nlohmann-json and Catch2 (v2 on Debian 12, v3 on Debian 13),
# gloo's headers (see csrc/zeroshard/process_group.cpp, Note [gloo headers]), ccache.
missing=()
for pkg in nlohmann-json3-dev catch2 libgloo-dev ccache; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python packages. torch 2.13.0 is the CPU wheel this machine keeps on disk; never let pip
# resolve a bare "torch" (that would fetch a multi-GB CUDA build).
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q torch==2.13.0
fi
pip_missing=()
"$PYTHON" -c "import pytest" >/dev/null 2>&1 || pip_missing+=(pytest)
"$PYTHON" -c "import pybind11" >/dev/null 2>&1 || pip_missing+=(pybind11)
# The tests read checkpoints with the reference safetensors reader, not only zeroshard's own.
"$PYTHON" -c "import safetensors" >/dev/null 2>&1 || pip_missing+=(safetensors)
command -v ninja >/dev/null 2>&1 || pip_missing+=(ninja)
command -v cmake >/dev/null 2>&1 || pip_missing+=(cmake)
if [ ${#pip_missing[@]} -gt 0 ]; then
  PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q "${pip_missing[@]}"
fi

# Build (ccache keeps rebuilds cheap on 2 cores) and install in place.
export CCACHE_DIR=${CCACHE_DIR:-${HOME:-/root}/.cache/ccache}
# Paths under the checkout hash as relative ones, so every clone shares the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
export PIP_ROOT_USER_ACTION=ignore
ZEROSHARD_BUILD_JOBS=${ZEROSHARD_BUILD_JOBS:-$(nproc)} \
  "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
"$PYTHON" -c "import zeroshard" || { echo "setup: the build did not produce an importable zeroshard" >&2; exit 1; }
