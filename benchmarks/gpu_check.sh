#!/usr/bin/env bash
# The GPU check (issues 7 and 29), for a machine with one NVIDIA GPU and a CUDA build of torch,
# CMake, ninja and a compiler, and no network. Its default plan fits a device lease of 10-15
# minutes (of which the machine takes 2-4 to start): GPU_CHECK_BUDGET=480 s of phases, every
# GPU phase first. It configures and builds what those phases need (the library, the Python
# module and the C++ example; CMake + ninja on every core, into build-gpu/), then runs
# tests/python/test_cuda*.py (every stage on CUDA at world size 1 with NCCL, stage 3's gathers on
# the compute stream and on a side stream, offload, fp16, checkpoints, meta init), the C++ example on the
# GPU (ZeRO-3 over NCCL from C++), and benchmarks/bench_gpu.py (a ~1B GPT in bf16: plain, zeroshard
# stage 3, FSDP2, stage 3 with its gathers on a side stream, then the other rows, in whatever time
# is left). The CPU-only phases come last and are skipped by default: ctest (which compiles the
# Catch2 suite first: only a plan that runs it configures and compiles it) and the CPU pytest cases
# at world size 1. Prints a short table last. With $OUT set, the whole log goes to
# $OUT/gpu_check.log, the bench numbers to $OUT/bench_gpu.*.
#
#   bash scripts/vendor_headers.sh    # first, on a machine with the Debian packages (see below)
#   bash benchmarks/gpu_check.sh      # then on the GPU machine, with third_party/ carried along
#
# benchmarks/README.md ("GPU check") has the exact device command. Header-only dependencies
# (nlohmann-json, Catch2 v2, gloo's headers) come from the system or from third_party/include, and
# Python.h from the interpreter or third_party/python<X.Y>/include (scripts/vendor_headers.sh):
# the environment phase says which. Every phase runs under `timeout`; the phases share
# GPU_CHECK_BUDGET seconds (default 480), of which BENCH_RESERVE (default 150) is kept for the
# benchmark. Knobs: PYTHON, BUILD_DIR, SKIP_BUILD=1 (reuse BUILD_DIR), GPU_CHECK_SKIP (phases to
# leave out; default "ctest pytest-cpu"; GPU_CHECK_SKIP=none runs every phase), BUILD_TARGETS (what
# the build phase builds; default the targets of the planned GPU phases; "all" for everything
# configured), BENCH_ARGS (extra bench_gpu.py flags, e.g. --rows), GPU_CHECK_ALLOW_CPU=1 (no CUDA
# device: a smoke run of this script, with BENCH_ARGS="--tiny --device cpu").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SCRIPT=$ROOT/benchmarks/gpu_check.sh

if [ -z "${PYTHON:-}" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
      PYTHON=$(command -v "$candidate"); break
    fi
  done
fi
export PYTHON=${PYTHON:-python3}
export BUILD_DIR=${BUILD_DIR:-$ROOT/build-gpu}
export JOBS=${JOBS:-$(nproc)}
export ARTIFACTS=${OUT:-$BUILD_DIR}
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
# Unset means the default plan; set (even to "none") means exactly those phases are left out.
export GPU_CHECK_SKIP=${GPU_CHECK_SKIP-ctest pytest-cpu}

planned() {
  [[ " $GPU_CHECK_SKIP " != *" $1 "* ]]
}

# Python.h for the module: the interpreter's, or the copy CMakeLists.txt falls back to. Prints
# where; fails when there is neither.
python_headers() {
  "$PYTHON" - "$ROOT" <<'EOF'
import os, sys, sysconfig
include = sysconfig.get_paths()["include"]
version = "%d.%d" % sys.version_info[:2]
vendored = os.path.join(sys.argv[1], "third_party", f"python{version}", "include")
if os.path.exists(os.path.join(include, "Python.h")):
    print(f"Python.h: {include} (the interpreter's)")
elif os.path.exists(os.path.join(vendored, "Python.h")):
    print(f"Python.h: not in {include}; CMake uses third_party/python{version}/include (vendored)")
else:
    print(f"Python.h: MISSING: not in {include}, and no third_party/python{version}/include. zeroshard._C is "
          f"not built: pytest-cuda and the benchmark's zeroshard rows fail, the C++ example still runs. Run "
          f"VENDOR_PYTHON_VERSIONS={version} bash scripts/vendor_headers.sh where a Python {version} with its "
          "headers is installed, and carry third_party/")
    sys.exit(1)
EOF
}

# ---------------------------------------------------------------------------------------------
# Phases: each runs as `bash gpu_check.sh --phase NAME` under timeout, so a stuck one is killed
# with its whole process group (compilers, ranks).

phase_environment() {
  nproc; free -g | head -2 || true
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  "$PYTHON" - <<'EOF'
import os, sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, CUDA {torch.version.cuda}")
cuda = torch.cuda.is_available()
print(f"torch.cuda.is_available(): {cuda}, devices: {torch.cuda.device_count()}")
if cuda:
    print(f"device 0: {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}")
if not cuda and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("gpu_check: torch sees no CUDA device; nothing here can be checked (GPU_CHECK_ALLOW_CPU=1 to go on)")
EOF
  echo "cmake: $(cmake --version | head -1); ninja: $(ninja --version 2>/dev/null || echo missing); " \
       "c++: $(c++ --version | head -1); nvcc: $(command -v nvcc || echo none)"
  python_headers || true
  for h in nlohmann/json.hpp catch2/catch.hpp gloo/rendezvous/store.h; do
    where=missing
    if [ -f "/usr/include/$h" ]; then where=system; elif [ -f "$ROOT/third_party/include/$h" ]; then where=third_party; fi
    echo "header $h: $where"
  done
}

# torch's CMake package for a CUDA build enables the CUDA language, which needs nvcc. Without a
# toolkit this shim stands in for what torch's cuda.cmake would define: the targets torch's
# exported targets name, with the CUDA and NCCL headers and libcudart of the nvidia-* wheels
# torch depends on. zeroshard compiles no CUDA code; it only includes c10/cuda and NCCL headers.
write_no_nvcc_shim() {
  "$PYTHON" - "$1" <<'EOF'
import glob, importlib.util, os, re, sys, sysconfig
# Located, not imported (as CMakeLists.txt does): torch's CMake package and the site-packages
# that hold it, where its nvidia-* wheels are.
torch_dir = importlib.util.find_spec("torch").submodule_search_locations[0]
prefix = os.path.join(torch_dir, "share", "cmake")
names = {"torch::cudart", "torch::nvtoolsext"}
for f in glob.glob(os.path.join(prefix, "Caffe2", "Caffe2Targets*.cmake")) + \
         glob.glob(os.path.join(prefix, "Torch", "TorchConfig.cmake")):
    # Only what cuda.cmake would define; the other public/*.cmake (mkl, ...) still run.
    names |= set(re.findall(r"\b(?:(?:torch|caffe2)::(?:cu|nv|magma)\w*|CUDA::\w+)", open(f).read()))
roots = {os.path.dirname(torch_dir)} | {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
incs, cudart = [], None
for root in roots:
    for inc in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")) +
                      glob.glob(os.path.join(root, "nvidia", "*", "*", "include"))):
        incs.append(inc)
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"), recursive=True)):
        cudart = cudart or lib
for cuda_home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
    if cuda_home and os.path.isdir(os.path.join(cuda_home, "include")):
        incs.append(os.path.join(cuda_home, "include"))
if not any(os.path.exists(os.path.join(i, "cuda_runtime_api.h")) for i in incs):
    sys.exit("gpu_check: no nvcc and no cuda_runtime_api.h in the nvidia-* wheels or CUDA_HOME: cannot build")
print(f"shim: {len(names)} targets, {len(incs)} include dirs, libcudart {cudart}")
with open(sys.argv[1], "w") as out:
    out.write("# Written by benchmarks/gpu_check.sh (no CUDA toolkit): see write_no_nvcc_shim there.\n")
    for name in sorted(names):
        out.write(f"if(NOT TARGET {name})\n  add_library({name} INTERFACE IMPORTED)\nendif()\n")
    out.write("set_property(TARGET torch::cudart PROPERTY INTERFACE_INCLUDE_DIRECTORIES\n  "
              + "\n  ".join(f'"{i}"' for i in incs) + ")\n")
    if cudart:
        out.write(f'set_property(TARGET torch::cudart PROPERTY INTERFACE_LINK_LIBRARIES "{cudart}")\n')
EOF
}

# ProcessGroupNCCL.hpp includes <nccl.h>, which neither torch's CMake package nor the CUDA toolkit
# provides when NCCL comes from the nvidia-nccl wheel: find it for the compiler. The wheel's beside
# torch first (the NCCL torch was built against: c10d's headers test NCCL_* macros), the
# toolkit's and the system's last.
nccl_include_dir() {
  "$PYTHON" - <<'EOF'
import glob, importlib.util, os, sysconfig
dirs = []
torch_site = os.path.dirname(importlib.util.find_spec("torch").submodule_search_locations[0])
for root in [torch_site] + sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")} - {torch_site}):
    dirs += sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")))
dirs += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), "/usr/include"]
print(next((d for d in dirs if os.path.exists(os.path.join(d, "nccl.h"))), ""))
EOF
}

phase_configure() {
  local args=(-S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DPython3_EXECUTABLE=$PYTHON")
  local nccl
  nccl=$(nccl_include_dir)
  echo "nccl.h: ${nccl:-not found (a CUDA build of zeroshard will not compile process_group.cpp)}"
  if [ -n "$nccl" ] && [ "$nccl" != /usr/include ]; then args+=("-DCMAKE_CXX_FLAGS=-isystem $nccl"); fi
  # Only what the plan runs is configured: without ctest no Catch2 suite (and no Catch2 needed).
  local tests=OFF examples=OFF
  case " ${BUILD_TARGETS:-} " in *" all "* | *" zeroshard_tests "*) tests=ON ;; esac
  case " ${BUILD_TARGETS:-} " in *" all "* | *" zeroshard_train_example "*) examples=ON ;; esac
  if planned ctest; then tests=ON; fi
  if planned cpp-cuda; then examples=ON; fi
  args+=("-DZEROSHARD_BUILD_TESTS=$tests" "-DZEROSHARD_BUILD_EXAMPLES=$examples")
  if python_headers; then args+=(-DZEROSHARD_BUILD_PYTHON=ON); else args+=(-DZEROSHARD_BUILD_PYTHON=OFF); fi
  echo "configure: Catch2 tests $tests, examples $examples"
  if cmake "${args[@]}"; then return 0; fi
  # torch's cuda.cmake wants a whole toolkit (nvcc, libcudart, libnvrtc, ...); an image with nvcc
  # but a partial toolkit fails it as surely as one without (seen with a pip-installed nvcc).
  echo "gpu_check: configure failed (CUDA toolkit: $(command -v nvcc || echo 'no nvcc')); retrying with the no-toolkit shim"
  rm -rf "$BUILD_DIR"; mkdir -p "$BUILD_DIR"
  write_no_nvcc_shim "$BUILD_DIR/no_nvcc_shim.cmake"
  cmake "${args[@]}" "-DCMAKE_PROJECT_INCLUDE=$BUILD_DIR/no_nvcc_shim.cmake"
}

# What the build phase builds: BUILD_TARGETS, or what the planned GPU phases run (the Catch2 suite
# is ctest's own to build, after the GPU phases).
build_targets() {
  if [ -n "${BUILD_TARGETS:-}" ]; then echo "$BUILD_TARGETS"; return; fi
  local targets=zeroshard
  if grep -q '^ZEROSHARD_BUILD_PYTHON:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then targets+=" zeroshard_python"; fi
  if planned cpp-cuda; then targets+=" zeroshard_train_example"; fi
  echo "$targets"
}

phase_build() {
  local targets
  targets=$(build_targets)
  echo "build: $targets"
  if [ "$targets" = all ]; then
    cmake --build "$BUILD_DIR" --parallel "$JOBS"
  else
    # shellcheck disable=SC2086  # a list of targets
    cmake --build "$BUILD_DIR" --parallel "$JOBS" --target $targets
  fi
  if ! ls "$BUILD_DIR"/python/zeroshard/_C*.so >/dev/null 2>&1; then
    echo "build: no zeroshard._C (see the environment phase's Python.h line)"; return 0
  fi
  # What `pip install -e .` does: the module and its core library beside the Python sources.
  cp -f "$BUILD_DIR"/python/zeroshard/_C*.so "$BUILD_DIR"/python/zeroshard/libzeroshard.so* "$ROOT/python/zeroshard/"
  "$PYTHON" -c "import zeroshard, torch; print('zeroshard imports; torch', torch.__version__)"
}

phase_ctest() {
  # The Catch2 tests are CPU tests (Gloo at 1-4 ranks on one machine); with a GPU visible the C++
  # process-group helper would also put rank r on cuda:r, which one GPU does not have.
  # find_package_consumer (a separate CMake project against the installed package) is left out.
  # The suite is compiled here, after the GPU phases, so that it never delays them.
  cmake --build "$BUILD_DIR" --parallel "$JOBS" --target zeroshard_tests
  CUDA_VISIBLE_DEVICES= ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 120 -E find_package_consumer
}

phase_pytest_cuda() {
  # The parity and no-sync checks first (both ways of stage 3's gathers, zeroshard.stage3_gather_stream
  # off and on), then offload and fp16, then checkpoints, save_16bit_model and meta init.
  "$PYTHON" -m pytest tests/python/test_cuda.py tests/python/test_cuda_features.py tests/python/test_cuda_state.py \
    -q -rs -p no:cacheprovider
}

phase_cpp_cuda() {
  # The C++ training example on the GPU: initProcessGroupFromEnv's NCCL branch, a CUDA module
  # built in C++, ZeRO-3 in fp32 and bf16. Each run must lower its loss.
  local config out final first
  for config in configs/zero3.json configs/bf16.json; do
    out=$("$BUILD_DIR/examples/cpp/zeroshard_train_example" --device cuda --steps 40 --config "$config" 2>&1) \
      || { echo "$out"; echo "gpu_check: the C++ example failed with $config"; return 1; }
    echo "$out" | grep -E "^zeroshard example|^final loss"
    read -r final first < <(echo "$out" | sed -n 's/^final loss \([0-9.e+-]*\) (first loss \([0-9.e+-]*\))$/\1 \2/p') || true
    if [ -z "$first" ] || ! awk -v f="$final" -v s="$first" 'BEGIN { exit !(f < s) }'; then
      echo "gpu_check: with $config the loss did not fall (final ${final:-?}, first ${first:-?})"; return 1
    fi
  done
}

phase_pytest_cpu() {
  # The CPU suite's cases at world size 1 (parametrized world_size != 1 deselected by a one-hook
  # plugin), GPUs hidden: these are the Gloo paths, built against this machine's torch.
  local plugin_dir
  plugin_dir=$(mktemp -d)
  cat > "$plugin_dir/world_size_one.py" <<'EOF'
def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        size = getattr(getattr(item, "callspec", None), "params", {}).get("world_size", 1)
        (keep if size == 1 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
EOF
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=$plugin_dir:$PYTHONPATH "$PYTHON" -m pytest tests/python \
    -q -p no:cacheprovider -p world_size_one --ignore-glob='tests/python/test_cuda*.py'
}

phase_bench() {
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  "$PYTHON" benchmarks/bench_gpu.py --budget "$BENCH_BUDGET" --json "$ARTIFACTS/bench_gpu.json" \
    --markdown "$ARTIFACTS/bench_gpu.md" ${BENCH_ARGS:-}
}

if [ "${1:-}" = "--phase" ]; then
  "phase_${2//-/_}"
  exit
fi

# ---------------------------------------------------------------------------------------------
# The run

# A lease of 10-15 minutes: ~2-4 minutes for the machine to start, 480 s of phases, the rest for
# the transfers and the summary (a 10-minute lease with a slow start: GPU_CHECK_BUDGET=420).
BUDGET=${GPU_CHECK_BUDGET:-480}
BENCH_RESERVE=${BENCH_RESERVE:-150}
DEADLINE=$((SECONDS + BUDGET))
STATUS=()
FAILED=0
BENCH_DONE=0

# run_phase NAME CAP_SECONDS [best-effort]: at most CAP, and never into the benchmark's reserve.
# A best-effort phase that runs out of time is reported as incomplete, not as a failure.
run_phase() {
  local name=$1 cap=$2 best_effort=${3:-} left rc=0 t0=$SECONDS result
  left=$((DEADLINE - SECONDS))
  if [ "$name" != bench ] && [ "$BENCH_DONE" = 0 ]; then left=$((left - BENCH_RESERVE)); fi
  if ! planned "$name"; then
    STATUS+=("$name|skipped (GPU_CHECK_SKIP)|0"); return 0
  fi
  if [ "$cap" -gt "$left" ]; then cap=$left; fi
  if [ "$cap" -lt 10 ]; then
    echo "== $name: skipped, the time budget is spent"
    STATUS+=("$name|skipped (time budget)|0"); return 3
  fi
  echo; echo "== $name (at most $cap s, $(date -u +%H:%M:%S) UTC)"
  BENCH_BUDGET=$((cap - 15)) timeout --kill-after=15 "$cap" bash "$SCRIPT" --phase "$name" || rc=$?
  case $rc in
    0) result=ok ;;
    124 | 137) result="TIMED OUT ($cap s)" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  if [ -n "$best_effort" ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
    result="incomplete: the time budget ran out ($cap s)"; rc=0
  fi
  STATUS+=("$name|$result|$((SECONDS - t0))")
  if [ "$rc" -ne 0 ]; then FAILED=1; fi
  return "$rc"
}

summary() {
  echo
  local log="not kept (OUT is unset)"
  if [ -n "${OUT:-}" ]; then log=$OUT/gpu_check.log; fi
  echo "## gpu_check: $SECONDS s in all (budget $BUDGET s); log: $log"
  echo
  echo "| phase | result | seconds |"
  echo "|---|---|---:|"
  for s in "${STATUS[@]}"; do echo "| ${s//|/ | } |"; done
  if [ -f "$ARTIFACTS/bench_gpu.md" ]; then
    echo
    cat "$ARTIFACTS/bench_gpu.md"
  fi
}

main() {
  echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $ROOT at $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
       "$(git status --porcelain 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
  rm -f "$ARTIFACTS/bench_gpu.md" "$ARTIFACTS/bench_gpu.json"
  echo "gpu_check: plan: $BUDGET s, $BENCH_RESERVE of them kept for the benchmark; left out: ${GPU_CHECK_SKIP:-nothing}"
  if run_phase environment 45; then
    if [ "${SKIP_BUILD:-0}" = 1 ] || { run_phase configure 90 && run_phase build 240; }; then
      # The GPU phases first; the CPU-only ones in whatever time the benchmark left.
      # The C++ example first: half a minute, and the one check of NCCL from C++.
      run_phase cpp-cuda 60 || true
      run_phase pytest-cuda 180 || true
      run_phase bench $((DEADLINE - SECONDS - 5)) || true
      BENCH_DONE=1
      run_phase ctest 300 best-effort || true
      run_phase pytest-cpu 150 best-effort || true
    fi
  fi
  summary
  return "$FAILED"
}

mkdir -p "$ARTIFACTS"
if [ -n "${OUT:-}" ]; then
  main 2>&1 | tee "$OUT/gpu_check.log"
else
  main 2>&1
fi
