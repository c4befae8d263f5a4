"""An engine is gone once nothing of the user's holds it: nothing zeroshard does (or makes torch
do) inside initialize() keeps its frame alive. Held in a fresh interpreter, because the first
import of torch._dynamo is what kept it (Note [torch._dynamo imported here]): an engine left to
the interpreter's final teardown took its process group with it, and Gloo aborted the process
there after a run that had succeeded (the restart test's failure on CI)."""

import subprocess
import sys

_SCRIPT = r"""
import gc, weakref
import torch, zeroshard
gc.disable()  # nothing may depend on the cycle collector
zeroshard.init_distributed()
alive = {}
def train(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = zeroshard.Config.from_dict({
        "train_batch_size": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine = zeroshard.initialize(model, config)
    engine.backward(engine(torch.randn(2, 8)).square().sum())
    engine.step()
    alive[stage] = weakref.ref(engine)
for stage in (0, 1, 2, 3):
    train(stage)
print("alive:", [stage for stage, ref in alive.items() if ref() is not None])
"""


def test_an_engine_no_one_holds_is_freed_without_the_cycle_collector(tmp_path):
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "alive: []" in done.stdout, done.stdout + done.stderr
