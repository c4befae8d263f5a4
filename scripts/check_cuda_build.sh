#!/usr/bin/env bash
# Builds zeroshard against a CUDA build of torch on a machine without a GPU, to find build
# breaks before a GPU machine's time is spent on them: the NCCL code (process_group.cpp), the
# torch-version branches (communicator.cpp) and gpu_check.sh's configure
# phase, which is the one run here. Nothing is installed: the torch wheel (with its CMake
# package, headers and libraries) and the headers of the nvidia-* wheels it depends on are
# downloaded (--no-deps, about 1 GB) and unpacked into a cache laid out as that machine's
# site-packages; nvidia-nccl is the exact version the torch wheel requires (its METADATA), so
# the nccl.h compiled against is the one that machine's pip installs. The current Python finds
# that torch through PYTHONPATH, which is enough since the build locates torch without
# importing it. Builds the core library, the Python module, the Catch2 tests and the C++ example
# (the executables linked with --allow-shlib-undefined: the CUDA libraries torch's own libraries
# need, cuDNN and the like, are not downloaded), then checks that every symbol the two libraries
# take from torch is defined by that torch's libraries.
#
#   bash scripts/check_cuda_build.sh                  # torch 2.11.0, the GPU image's (CUDA 13.0)
#   TORCH_VERSION=2.13.0 bash scripts/check_cuda_build.sh
#
# Knobs: TORCH_VERSION, CUDA_CHECK_CACHE (default ~/.cache/zeroshard-cuda-check: a second run
# reuses the unpacked wheels, and ccache the objects), BUILD_DIR, JOBS (default: every core).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
CACHE=${CUDA_CHECK_CACHE:-$HOME/.cache/zeroshard-cuda-check}/torch-$TORCH_VERSION
SITE=$CACHE/site
BUILD_DIR=${BUILD_DIR:-$CACHE/build}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

# The nvidia-nccl-cuNN==X.Y.Z that a torch wheel's METADATA requires ("" for a CPU wheel).
nccl_requirement() {
  "$PYTHON" - "$1" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    text = wheel.read(metadata).decode()
pins = re.findall(r"^Requires-Dist: (nvidia-nccl-cu\d+==[\w.]+)", text, re.M)
print(pins[0] if pins else "")
EOF
}

# A cache unpacked before the NCCL pin (no .nccl-requirement) is unpacked again.
if [ ! -f "$SITE/.complete" ] || [ ! -f "$SITE/.nccl-requirement" ]; then
  # Downloaded wheels stay until unpacked: an interrupted run resumes without fetching them again.
  rm -rf "$SITE"; mkdir -p "$CACHE/wheels" "$SITE"
  "$PYTHON" -m pip download -q --no-deps -d "$CACHE/wheels" "torch==$TORCH_VERSION"
  nccl=$(nccl_requirement "$(ls "$CACHE"/wheels/torch-"$TORCH_VERSION"-*.whl | head -1)")
  if [ -z "$nccl" ]; then
    echo "check_cuda_build: torch $TORCH_VERSION's wheel requires no nvidia-nccl-cuNN==X.Y.Z: not a CUDA build?" >&2
    exit 1
  fi
  echo "check_cuda_build: torch $TORCH_VERSION requires $nccl"
  rm -f "$CACHE"/wheels/nvidia_nccl*.whl  # another version, left by an interrupted run, would unpack over it
  # PyPI's Linux torch wheels are CUDA builds; cu13 headers for what ATen/cuda includes.
  "$PYTHON" -m pip download -q --no-deps -d "$CACHE/wheels" "$nccl" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-nvrtc==13.0.*" nvidia-cublas nvidia-cusparse nvidia-cusolver
  for w in "$CACHE"/wheels/*.whl; do
    case $(basename "$w") in
      torch-*) rm -rf "$CACHE/torch-wheel"; "$PYTHON" -m zipfile -e "$w" "$CACHE/torch-wheel"
               mv "$CACHE/torch-wheel/torch" "$SITE/torch"; rm -rf "$CACHE/torch-wheel" ;;
      *) "$PYTHON" -m zipfile -e "$w" "$SITE" ;;
    esac
  done
  echo "$nccl" > "$SITE/.nccl-requirement"
  rm -rf "$CACHE/wheels"
  touch "$SITE/.complete"
fi
grep -m1 "^__version__" "$SITE/torch/version.py"

# The nccl.h that was unpacked is the version torch requires: read from the header, not assumed.
nccl_header=$SITE/nvidia/nccl/include/nccl.h
[ -f "$nccl_header" ] || { echo "check_cuda_build: no $nccl_header; remove $CACHE and rerun" >&2; exit 1; }
nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9][0-9]*\).*/\2/p' "$nccl_header" | paste -sd.)
nccl_required=$(cat "$SITE/.nccl-requirement")
echo "nccl.h: $nccl_version; torch $TORCH_VERSION requires $nccl_required"
if [ "$nccl_version" != "${nccl_required##*==}" ]; then
  echo "check_cuda_build: nccl.h is $nccl_version, not the ${nccl_required##*==} torch requires; remove $CACHE and rerun" >&2
  exit 1
fi

export PYTHONPATH=$SITE PYTHON BUILD_DIR
# Configured with the Catch2 tests and the examples (gpu_check.sh's default plan leaves the tests
# out). Their executables link against torch's libraries, which need the CUDA libraries that are
# not downloaded (cuDNN, cuFFT, NVSHMEM, ...): ld is told not to resolve the symbols *those*
# libraries take from others (CMake reads LDFLAGS at the first configure), while every symbol the
# executables themselves use must still resolve. (Compiling the objects alone through ninja is
# not possible: the Catch2 suite's objects wait for its worker executables, add_dependencies.)
export GPU_CHECK_SKIP=none LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--allow-shlib-undefined"
rm -rf "$BUILD_DIR"
bash "$ROOT/benchmarks/gpu_check.sh" --phase configure
grep -q "ZEROSHARD_WITH_NCCL" "$BUILD_DIR/compile_commands.json" \
  || { echo "check_cuda_build: the build did not enable NCCL"; exit 1; }
tests=$(grep -c '"file": ".*/tests/cpp/' "$BUILD_DIR/compile_commands.json" || true)
examples=$(grep -c '"file": ".*/examples/cpp/' "$BUILD_DIR/compile_commands.json" || true)
if [ "$tests" = 0 ] || [ "$examples" = 0 ]; then
  echo "check_cuda_build: the build has $tests sources of tests/cpp and $examples of examples/cpp; both must be in" >&2
  exit 1
fi
echo "check_cuda_build: building the library, the module, the Catch2 tests ($tests sources) and the C++ example"
cmake --build "$BUILD_DIR" --parallel "$JOBS"

status=0
# No binary may bind std::filesystem::remove_all, which torch's libtorch.so re-exports in a copy
# that crashes on libstdc++ < 13 (Note [trees without std::filesystem] in remove_tree.h).
for bin in "$BUILD_DIR"/python/zeroshard/*.so "$BUILD_DIR"/tests/cpp/zeroshard_* "$BUILD_DIR"/examples/cpp/zeroshard_*; do
  [ -f "$bin" ] && [ -x "$bin" ] || continue
  if nm -D --undefined-only "$bin" | c++filt | grep -c "std::filesystem::remove_all" >/dev/null; then
    echo "check_cuda_build: $(basename "$bin") imports std::filesystem::remove_all; use zeroshard::removeTree"
    status=1
  fi
done

# Every symbol the two libraries import from torch must be one that torch's libraries export.
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
[ "$status" = 0 ] && echo "check_cuda_build: zeroshard (library, module, Catch2 tests, C++ example) builds against torch $TORCH_VERSION (CUDA, NCCL with nccl.h $nccl_version); every torch symbol resolves"
exit "$status"
