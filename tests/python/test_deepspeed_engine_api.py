"""DeepSpeedEngine's methods for Hugging Face's Trainer and accelerate (zeroshard.deepspeed):
_zero3_consolidated_16bit_state_dict (the whole 16-bit state dict on rank 0, None elsewhere, at
stage 3 without the gather flag; a peft model's adapters that save_pretrained(state_dict=...)
writes as peft does), zero_gather_16bit_weights_on_model_save (the config's flag under either
name) and destroy() (hooks removed, the C++ engine freed, every later call a clear error).
2 ranks (Gloo), one spawned pair for every case (spawn.SharedRuns). The accumulation boundary:
test_accumulation_boundary.py.
"""

import gc
import os
import weakref

import pytest
import torch

from models import global_batch, make_stateful_model
from spawn import SharedRuns
from training import engine_config

WORLD, MICRO = 2, 2


def _config(stage, precision="bf16", **zero):
    config = engine_config(stage, micro=MICRO, precision=precision,
                           zero={"stage3_param_persistence_threshold": 0, **zero})
    config["train_batch_size"] = MICRO * WORLD
    return config


def _train(engine, rank, steps=2):
    for step in range(steps):
        tokens = global_batch(step, MICRO * WORLD)[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine.module.loss(tokens))
        engine.step()


def _consolidated(rank, world_size):
    import zeroshard.deepspeed as deepspeed

    engine, *_ = deepspeed.initialize(model=make_stateful_model(0), config=_config(3))
    _train(engine, rank)
    return dict(state=engine._zero3_consolidated_16bit_state_dict(),
                without_frozen=engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True),
                full=engine._engine.full_state_dict(), flag=engine.zero_gather_16bit_weights_on_model_save())


def _gather_flags(rank, world_size):
    """zero_gather_16bit_weights_on_model_save() for each way the config can say it."""
    import zeroshard.deepspeed as deepspeed

    flags = {}
    for key, stage in (("stage3_gather_16bit_weights_on_model_save", 3), ("stage3_gather_fp16_weights_on_model_save", 3),
                       ("stage3_gather_16bit_weights_on_model_save", 1), (None, 3)):
        zero = {} if key is None else {key: True}
        engine, *_ = deepspeed.initialize(model=make_stateful_model(0), config=_config(stage, **zero))
        flags[(key, stage)] = engine.zero_gather_16bit_weights_on_model_save()
    return flags


def _peft_adapters(rank, world_size, out):
    """The Trainer's save of a peft model at stage 3: the consolidated state dict without the
    frozen base, handed to the model's save_pretrained on rank 0."""
    import peft
    from safetensors.torch import load_file

    import lora_runs
    import zeroshard.deepspeed as deepspeed

    model = lora_runs.lora_model("bf16")
    config = lora_runs.engine_config(world_size, 3)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    engine, *_ = deepspeed.initialize(model=model, config=config)
    lora_runs.train(engine, rank, world_size, range(1))
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        expected = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    if state is None:
        return None
    model.save_pretrained(out, state_dict=state)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return dict(keys=list(state), trained=trained, written=load_file(os.path.join(out, "adapter_model.safetensors")),
                expected=expected)


def _hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _destroy(rank, world_size, stage, directory):
    import zeroshard.deepspeed as deepspeed

    model = make_stateful_model(0)
    before = _hook_count(model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=_config(stage))
    installed = _hook_count(model)
    _train(engine, rank, steps=1)
    engine.save_checkpoint(directory)
    tokens = global_batch(7, MICRO)
    with torch.no_grad():
        logits = engine(tokens) if stage < 3 else None
    # A backward without its step: the gradients it left are what destroy() must drop.
    engine.backward(engine.module.loss(global_batch(8, MICRO * WORLD)[rank * MICRO:(rank + 1) * MICRO]))
    grads_before = [p.grad is not None for p in model.parameters()]
    inner, core = engine._engine, weakref.ref(engine._engine._core)
    engine.destroy()
    engine.destroy()  # a second call does nothing
    gc.collect()
    out = dict(hooks=(before, installed, _hook_count(model)), core_freed=core() is None,
               grads=[p.grad is None for p in model.parameters()], grads_before=grads_before)
    if stage < 3:  # the model alone, with the weights it was trained to
        with torch.no_grad():
            out["same logits"] = torch.equal(model(tokens), logits)
    calls = {
        "engine(tokens)": lambda: engine(tokens),
        "backward": lambda: engine.backward(torch.zeros((), requires_grad=True)),
        "step": engine.step,
        "train_batch_size": engine.train_batch_size,
        "get_lr": engine.get_lr,
        "is_gradient_accumulation_boundary": engine.is_gradient_accumulation_boundary,
        "save_checkpoint": lambda: engine.save_checkpoint(directory),
        "load_checkpoint": lambda: engine.load_checkpoint(directory),
        "save_16bit_model": lambda: engine.save_16bit_model(directory),
        "_zero3_consolidated_16bit_state_dict": engine._zero3_consolidated_16bit_state_dict,
        "zero_gather_16bit_weights_on_model_save": engine.zero_gather_16bit_weights_on_model_save,
        "GatheredParameters": lambda: deepspeed.zero.GatheredParameters(list(model.parameters())).__enter__(),
        "zeroshard.Engine.step": inner.step,
        "zeroshard.Engine.full_state_dict": inner.full_state_dict,
        "zeroshard.Engine(tokens)": lambda: inner(tokens),
        "optimizer.pull": optimizer.pull,
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # the type and message are what the test holds
            errors[name] = (type(e).__name__, str(e))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return SharedRuns({WORLD: {
        "consolidated": (_consolidated,),
        "gather_flags": (_gather_flags,),
        "peft": (_peft_adapters, str(tmp_path_factory.mktemp("peft"))),
        "destroy_stage1": (_destroy, 1, str(tmp_path_factory.mktemp("destroy1"))),
        "destroy_stage3": (_destroy, 3, str(tmp_path_factory.mktemp("destroy3"))),
    }})


def test_the_consolidated_16bit_state_dict_at_stage_3_needs_no_gather_flag(runs):
    out, other = runs.result(WORLD, "consolidated")
    assert out["flag"] is False
    assert list(out["state"]) == list(out["full"])
    for name, value in out["full"].items():
        assert out["state"][name].dtype == value.dtype and torch.equal(out["state"][name], value), name
    assert out["state"]["embed.weight"].dtype == torch.bfloat16
    assert out["state"]["head.weight"] is out["state"]["embed.weight"]
    assert list(out["without_frozen"]) == [name for name in out["full"] if name != "frozen"]
    assert other["state"] is None and other["without_frozen"] is None


def test_zero_gather_16bit_weights_on_model_save_reads_the_config_under_either_name(runs):
    for flags in runs.result(WORLD, "gather_flags"):
        assert flags == {("stage3_gather_16bit_weights_on_model_save", 3): True,
                         ("stage3_gather_fp16_weights_on_model_save", 3): True,
                         ("stage3_gather_16bit_weights_on_model_save", 1): True,
                         (None, 3): False}


def test_a_peft_models_adapters_save_as_the_trainer_saves_them(runs):
    pytest.importorskip("peft")
    out, other = runs.result(WORLD, "peft")
    assert other is None
    assert out["keys"] == out["trained"]  # the module's own names, the frozen base left out
    assert sorted(out["written"]) == sorted(out["expected"])
    for name, value in out["expected"].items():
        assert torch.equal(out["written"][name], value), name


@pytest.mark.parametrize("stage", [1, 3])
def test_destroy_removes_the_hooks_frees_the_engine_and_refuses_later_calls(runs, stage):
    for out in runs.result(WORLD, f"destroy_stage{stage}"):
        before, installed, after = out["hooks"]
        assert before == 0 and installed > 0 and after == 0
        assert out["core_freed"]
        assert all(out["grads"])
        if stage < 3:  # stage 3 keeps no full gradients on the parameters
            assert any(out["grads_before"])
            assert out["same logits"]
        for name, error in out["errors"].items():
            assert error is not None, f"{name} did not fail after destroy()"
            kind, message = error
            assert kind == "RuntimeError" and "was destroyed" in message, (name, error)
