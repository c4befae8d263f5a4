import os
import sys

HERE = os.path.dirname(__file__)
# The helpers beside the tests (spawn, models, training); spawned ranks inherit sys.path from the
# parent. benchmarks/ for model_state.py, the memory formulas the benchmarks print too.
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, os.pardir, os.pardir, "benchmarks"))

WORLD_SIZES = [1, 2, 4]
