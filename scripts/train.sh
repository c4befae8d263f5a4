#!/usr/bin/env bash
# Sets up zeroshard and trains the small GPT of examples/train_gpt.py on 2 ranks
# (Gloo on CPU; one rank per GPU with NCCL when GPUs are present). Builds only what training
# needs: the core library and the Python extension, not the Catch2 tests or C++ examples.
# $PYTHON (default: the python3 on PATH) is set up and runs the job, e.g. PYTHON=.venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh --library-only
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/zero3.json}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" examples/train_gpt.py --config "$CONFIG" "$@"
