"""python -m zeroshard.convert: a checkpoint becomes one state dict (.safetensors or .pt) that
equals engine.full_state_dict() and loads into the plain model with strict=True, written in a
fresh interpreter with no process group and no GPU. The training runs that save the
checkpoints share one spawned run per world size (spawn.SharedRuns), each case with its own
result and failure."""

import os
import subprocess
import sys

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import damage as _damage
from checkpoint_runs import train as _train
from models import StatefulTransformer, make_stateful_model
from spawn import SharedRuns

PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="module")
def runs(ckpts):
    return SharedRuns({1: {"damaged": (_save_for_conversion, str(ckpts / "damaged"), "fp32")},
                       2: {p: (_save_for_conversion, str(ckpts / p), p) for p in PRECISIONS}})


def _save_for_conversion(rank, world_size, ckpt, precision):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 3, precision))
    _train(model, engine, rank, world_size, range(2))
    # A buffer replaced after initialize(): the checkpoint must hold the module's current one.
    model.temperature = model.temperature + 1.0
    engine.save_checkpoint(ckpt)
    state = engine.full_state_dict()  # collective: every rank gathers
    return state if rank == 0 else None


def _convert(*args):
    # A fresh interpreter with no process group and no GPU, as on a laptop.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "zeroshard.convert", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_converted_file_equals_full_state_dict_and_loads_into_the_plain_model(runs, ckpts, tmp_path, precision):
    from safetensors.torch import load_file

    full = runs.result(2, precision)[0]
    dtype_flag = ["--dtype", "bf16"] if precision == "bf16" else []
    _convert(ckpts / precision, tmp_path / "model.safetensors", *dtype_flag)
    _convert(ckpts / precision, tmp_path / "model.pt", *dtype_flag)
    # --dtype casts the trained parameters (and their second names); buffers and the frozen
    # parameter keep their dtype, as in the model's own state dict.
    trained = {n for n, p in StatefulTransformer().named_parameters(remove_duplicate=False) if p.requires_grad}
    expected = {k: v.to(torch.bfloat16) if precision == "bf16" and k in trained else v for k, v in full.items()}
    assert expected["steps"].dtype == torch.long and expected["frozen"].dtype == torch.float32
    for converted in (load_file(tmp_path / "model.safetensors"), torch.load(tmp_path / "model.pt", weights_only=True)):
        assert list(converted) == list(expected)  # the model's own names, in its order
        for name, value in expected.items():
            assert converted[name].dtype == value.dtype and torch.equal(converted[name], value), name
        plain = StatefulTransformer()
        plain.load_state_dict(converted, strict=True)


def test_convert_reports_a_damaged_checkpoint_and_writes_nothing(runs, ckpts, tmp_path):
    runs.result(1, "damaged")
    _damage(ckpts / "damaged" / "global_step2" / "rank_00000.safetensors", "flip")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "zeroshard.convert", str(ckpts / "damaged"),
                           str(tmp_path / "model.safetensors")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "checksum mismatch in" in done.stderr and "rank_00000.safetensors" in done.stderr
    assert not (tmp_path / "model.safetensors").exists()
