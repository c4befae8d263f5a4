#!/usr/bin/env bash
# Installs what zeroshard needs on a bare Debian machine, then builds it in place
# (pip install --no-build-isolation -e ., one CMake build in ./build). Running it again only
# rebuilds what changed.
#
#   bash scripts/setup.sh                  # everything: library, Python extension, Catch2 tests, C++ examples
#   bash scripts/setup.sh --library-only   # the core library and the Python extension (scripts/train.sh)
#
# Python packages and the extension go into $PYTHON (default: the python3 on PATH), e.g.
# PYTHON=.venv/bin/python for a virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

PYTHON=${PYTHON:-python3}
case "${1:---all}" in
  --all) build_what="library, Python extension, Catch2 tests, C++ examples"; build_rest=ON ;;
  --library-only) build_what="library and Python extension only"; build_rest=OFF ;;
  *) echo "usage: bash scripts/setup.sh [--all | --library-only]" >&2; exit 2 ;;
esac
command -v "$PYTHON" >/dev/null || { echo "setup: no Python at PYTHON=$PYTHON" >&2; exit 1; }
echo "setup: Python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.executable)'))"

# System packages: header-only nlohmann-json and Catch2 (v2 on Debian 12, v3 on Debian 13),
# gloo's headers (see csrc/zeroshard/process_group.cpp, Note [gloo headers]), ccache.
apt_packages=(nlohmann-json3-dev catch2 libgloo-dev ccache)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: apt: ${apt_packages[*]} already installed"
fi

# Python packages. torch 2.13.0 is the CPU wheel this machine keeps on disk; never let pip
# resolve a bare "torch" (that would fetch a multi-GB CUDA build).
export PIP_ROOT_USER_ACTION=ignore
if torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "setup: pip: torch $torch_version already installed"
else
  echo "setup: pip: installing torch==2.13.0"
  "$PYTHON" -m pip install -q torch==2.13.0
fi
pip_missing=()
"$PYTHON" -c "import pytest" >/dev/null 2>&1 || pip_missing+=(pytest)
"$PYTHON" -c "import pybind11" >/dev/null 2>&1 || pip_missing+=(pybind11)
# The tests read checkpoints with the reference safetensors reader, not only zeroshard's own.
"$PYTHON" -c "import safetensors" >/dev/null 2>&1 || pip_missing+=(safetensors)
# Issue 14's tests read save_16bit_model's file back with transformers' from_pretrained and use
# its scheduler helpers (tiny models built from configs: nothing is downloaded).
# Issue 31 (zeroshard.hf) pins the Trainer stack it is tested with: the integration overrides
# Trainer methods and routes accelerate's backward, both private surfaces that move between
# releases. A machine with other versions is told, not changed (docs/hf.md lists the pins).
"$PYTHON" -c "import transformers" >/dev/null 2>&1 || pip_missing+=(transformers==5.24.0)
# Issue 19's fuzz tests generate their inputs with hypothesis.
"$PYTHON" -c "import hypothesis" >/dev/null 2>&1 || pip_missing+=(hypothesis)
# Issue 30's LoRA tests train a real peft LoRA (peft brings accelerate) and load the adapter
# save_16bit_model exports with peft's own PeftModel.from_pretrained. Pinned: the tests hold the
# export to peft's adapter file names and keys, which peft has changed between releases.
"$PYTHON" -c "import peft" >/dev/null 2>&1 || pip_missing+=(peft==0.21.2)
# Issue 31's tests train with TRL's SFTTrainer (trl brings datasets) on the pinned accelerate.
"$PYTHON" -c "import accelerate" >/dev/null 2>&1 || pip_missing+=(accelerate==1.16.0)
"$PYTHON" -c "import trl" >/dev/null 2>&1 || pip_missing+=(trl==1.16.0)
for pinned in transformers==5.24.0 accelerate==1.16.0 trl==1.16.0 peft==0.21.2; do
  have=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('${pinned%%==*}'))" 2>/dev/null) || continue
  [ "$have" = "${pinned##*==}" ] || echo "setup: note: ${pinned%%==*} $have is installed; zeroshard.hf is tested with $pinned"
done
command -v ninja >/dev/null 2>&1 || pip_missing+=(ninja)
command -v cmake >/dev/null 2>&1 || pip_missing+=(cmake)
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "setup: pip: installing ${pip_missing[*]}"
  "$PYTHON" -m pip install -q "${pip_missing[@]}"
else
  echo "setup: pip: pytest pybind11 safetensors transformers hypothesis peft accelerate trl ninja cmake already installed"
fi

# Build (ccache keeps rebuilds cheap on 2 cores) and install in place.
export CCACHE_DIR=${CCACHE_DIR:-${HOME:-/root}/.cache/ccache}
# Paths under the checkout hash as relative ones, so every clone shares the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
# Both options every time: ./build keeps its cache between runs, and train.sh and test.sh
# share it, so each run states what it wants. The caller's own ZEROSHARD_CMAKE_ARGS come last.
export ZEROSHARD_CMAKE_ARGS="-DZEROSHARD_BUILD_TESTS=$build_rest -DZEROSHARD_BUILD_EXAMPLES=$build_rest${ZEROSHARD_CMAKE_ARGS:+ $ZEROSHARD_CMAKE_ARGS}"
echo "setup: building zeroshard ($build_what) in ./build, installing it in place"
# -v: pip shows the build's output (CMake's configure, ninja's [n/N] lines) as it runs.
ZEROSHARD_BUILD_JOBS=${ZEROSHARD_BUILD_JOBS:-$(nproc)} \
  "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e .
"$PYTHON" -c "import zeroshard" || { echo "setup: the build did not produce an importable zeroshard" >&2; exit 1; }
echo "setup: done in $((SECONDS - start)) s"
