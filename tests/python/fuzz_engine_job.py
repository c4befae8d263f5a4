"""One rank (a process group of one) for the fuzz tests that need an engine (test_fuzz_checkpoint.py).

  fuzz_engine_job.py save OUT          a checkpoint (OUT/ckpt, stage 3, one step, client state)
                                       and a pretrained file (OUT/model.safetensors, written by
                                       safetensors.torch) of the model below
  fuzz_engine_job.py fuzz OUT EXAMPLES  engine.load_checkpoint of damaged copies of OUT/ckpt and
                                       engine.load_pretrained of damaged copies of
                                       OUT/model.safetensors, each under the address-space bound

Each load either succeeds or raises RuntimeError naming the file, and a failed one leaves the
master weights, buffers, step count and lr bitwise as they were ("on any error nothing changes"). Prints one JSON
line: the examples run, how many loaded and how many failed, per target."""

import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import zeroshard
from zeroshard import _C
from fuzz_strategies import (MANIFEST_SIZES as SIZES, address_space_headroom, assert_named_error, damaged_bytes, damaged_safetensors,
                             fuzz_settings, json_values, mutated)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

    def forward(self, x):
        return self.body(x) * self.scale


def engine():
    torch.manual_seed(0)
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    e = zeroshard.initialize(Model(), zeroshard.Config.from_dict(config))
    e.backward(e(torch.randn(2, 4)).square().sum())
    e.step()
    return e


def save(out):
    e = engine()
    e.save_checkpoint(os.path.join(out, "ckpt"), client_state={"epoch": 3})
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in Model().state_dict().items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})


def snapshot(e):
    """What a load writes: the fp32 master weights, the buffers, the step count and the lr."""
    values = e.full_state_dict(dtype=torch.float32)
    values["global_steps"] = torch.tensor(e.global_steps)
    values["lrs"] = torch.tensor(e.get_lrs())
    return values


def unchanged(before, after, what):
    assert before.keys() == after.keys(), what
    for k in before:
        assert torch.equal(before[k], after[k]), f"{what}: a failed load changed {k}"


def fuzz(out, examples):
    e = engine()
    counts = {"checkpoint": [0, 0], "pretrained": [0, 0]}
    source = os.path.join(out, "ckpt")
    tag = open(os.path.join(source, "latest")).read().strip()
    manifest = json.load(open(os.path.join(source, tag, "manifest.json")))["manifest"]
    pretrained = open(os.path.join(out, "model.safetensors"), "rb").read()
    work = tempfile.mkdtemp(prefix="fuzz-", dir=out)

    def attempt(target, load, names):
        before = snapshot(e)
        try:
            with warnings.catch_warnings(), address_space_headroom():
                warnings.simplefilter("ignore")
                load()
            counts[target][0] += 1
        except Exception as error:  # held to a named RuntimeError, or the job fails
            assert_named_error(error, names, target)
            assert isinstance(error, RuntimeError), f"{target}: {type(error).__name__}: {error}"
            unchanged(before, snapshot(e), target)
            counts[target][1] += 1

    @fuzz_settings(examples)
    @given(st.data())
    def checkpoints(data):
        copy = os.path.join(work, "ckpt")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(source, copy)
        path = os.path.join(copy, tag, "manifest.json")
        if data.draw(st.booleans()):
            body = data.draw(mutated(manifest, json_values(), focus=lambda path: path[:1] != ("config",),
                                   sizes=SIZES))
            with open(path, "w") as f:
                f.write(_C._manifest_text_for_body(json.dumps(body)))
        else:
            with open(path, "rb") as f:
                text = f.read()
            with open(path, "wb") as f:
                f.write(data.draw(damaged_bytes(text)))
        attempt("checkpoint", lambda: e.load_checkpoint(copy), [copy])

    @fuzz_settings(examples)
    @given(damaged_safetensors(pretrained))
    def pretrained_files(damaged):
        path = os.path.join(work, "model.safetensors")
        with open(path, "wb") as f:
            f.write(damaged)
        attempt("pretrained", lambda: e.load_pretrained(path, strict=False), [path])

    checkpoints()
    pretrained_files()
    print(json.dumps({"examples": examples, "counts": counts}), flush=True)


if __name__ == "__main__":
    zeroshard.init_distributed()
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        fuzz(sys.argv[2], int(sys.argv[3]))
