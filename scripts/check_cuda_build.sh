#!/usr/bin/env bash
# Builds zeroshard against a CUDA build of torch on a machine without a GPU, to find build
# breaks before a GPU machine's time is spent on them: the NCCL code (process_group.cpp), the
# torch-version branches (communicator.cpp) and gpu_check.sh's configure phase, which is the one
# run here. Nothing is installed: the torch wheel (with its CMake package, headers and
# libraries) and the headers of the nvidia-* wheels it depends on are downloaded (--no-deps,
# about 1 GB) and unpacked into a cache laid out as that machine's site-packages; the current
# Python finds that torch through PYTHONPATH, which is enough since the build locates torch
# without importing it. Builds the core library and the Python module, compiles the C++ example
# (linking executables would need every CUDA library torch links), then checks that every symbol they take from torch is
# defined by that torch's libraries.
#
#   bash scripts/check_cuda_build.sh                  # torch 2.11.0, the GPU image's (CUDA 13.0)
#   TORCH_VERSION=2.13.0 bash scripts/check_cuda_build.sh
#
# Knobs: TORCH_VERSION, CUDA_CHECK_CACHE (default ~/.cache/zeroshard-cuda-check), BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
CACHE=${CUDA_CHECK_CACHE:-$HOME/.cache/zeroshard-cuda-check}/torch-$TORCH_VERSION
SITE=$CACHE/site
BUILD_DIR=${BUILD_DIR:-$CACHE/build}
PYTHON=${PYTHON:-python3}

if [ ! -f "$SITE/.complete" ]; then
  rm -rf "$CACHE"; mkdir -p "$CACHE/wheels" "$SITE"
  # PyPI's Linux torch wheels are CUDA builds; cu13 headers for what ATen/cuda includes.
  "$PYTHON" -m pip download -q --no-deps -d "$CACHE/wheels" "torch==$TORCH_VERSION" nvidia-nccl-cu13 \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-nvrtc==13.0.*" nvidia-cublas nvidia-cusparse nvidia-cusolver
  for w in "$CACHE"/wheels/*.whl; do
    case $(basename "$w") in
      torch-*) "$PYTHON" -m zipfile -e "$w" "$CACHE/torch-wheel"
               mv "$CACHE/torch-wheel/torch" "$SITE/torch"; rm -rf "$CACHE/torch-wheel" ;;
      *) "$PYTHON" -m zipfile -e "$w" "$SITE" ;;
    esac
  done
  rm -rf "$CACHE/wheels"
  touch "$SITE/.complete"
fi
grep -m1 "^__version__" "$SITE/torch/version.py"

export PYTHONPATH=$SITE PYTHON BUILD_DIR
rm -rf "$BUILD_DIR"
bash "$ROOT/benchmarks/gpu_check.sh" --phase configure
grep -q "ZEROSHARD_WITH_NCCL" "$BUILD_DIR/compile_commands.json" \
  || { echo "check_cuda_build: the build did not enable NCCL"; exit 1; }
cmake --build "$BUILD_DIR" --parallel "$(nproc)" --target zeroshard zeroshard_python
# The C++ example (its --device cuda path) compiles too; linking it needs every CUDA library.
cmake --build "$BUILD_DIR" --target examples/cpp/CMakeFiles/zeroshard_train_example.dir/train.cpp.o

# Every symbol the two libraries import from torch must be one that torch's libraries export.
status=0
exported=$(mktemp)
for lib in "$SITE"/torch/lib/lib*.so "$BUILD_DIR"/python/zeroshard/libzeroshard.so; do
  nm -D --defined-only "$lib" | awk '{print $3}'
done | sort -u > "$exported"
for so in "$BUILD_DIR"/python/zeroshard/libzeroshard.so "$BUILD_DIR"/python/zeroshard/_C*.so; do
  missing=$(nm -D --undefined-only "$so" | awk '{print $2}' | grep -E '^_ZN?K?(2at|3c10|4c10d|5torch|6caffe2)' \
            | sort -u | comm -23 - "$exported" | c++filt || true)
  if [ -n "$missing" ]; then
    echo "check_cuda_build: $(basename "$so") needs symbols torch $TORCH_VERSION does not export:"
    echo "$missing" | head -20
    status=1
  fi
done
rm -f "$exported"
[ "$status" = 0 ] && echo "check_cuda_build: zeroshard builds against torch $TORCH_VERSION (CUDA, NCCL); every torch symbol resolves"
exit "$status"
