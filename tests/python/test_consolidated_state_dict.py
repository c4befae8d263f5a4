"""consolidated_state_dict() (DeepSpeed's _zero3_consolidated_16bit_state_dict): on rank 0 the
model's whole state dict on CPU, every name in the module's order (a tied weight under both its
names, one tensor), trained parameters in the compute dtype, buffers and frozen parameters as
held: equal to the gathered full_state_dict(); None on the other ranks. At stage 3 it gathers one
unit at a time (its gathered peak is the largest unit's), with or without
stage3_gather_16bit_weights_on_model_save. exclude_frozen_parameters leaves out exactly the
frozen parameters, which at stage 3 are then not gathered (a LoRA base).

StatefulTransformer (a tied head, a frozen parameter, a float and a long buffer) trains two
steps at stages 1-3, fp32 and bf16, on 1 and 2 processes (Gloo); the cases of a world size share
one spawned run (spawn.SharedRuns). The C++ side alone: tests/cpp/engine/test_engine_export.cpp.
"""

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import train as _train
from model_state import padded_numel
from models import make_lora_model, make_stateful_model
from spawn import SharedRuns
from training import engine_config, train_global_batches

WORLD_SIZES = (1, 2)
STAGES = (1, 2, 3)
PRECISIONS = ("fp32", "bf16")
BYTES = {"fp32": 4, "bf16": 2}
TIED = ("embed.weight", "head.weight")


@pytest.fixture(scope="module")
def runs():
    cases = {}
    for ws in WORLD_SIZES:
        cases[ws] = {f"stage{s}_{p}": (_consolidated, s, p) for s in STAGES for p in PRECISIONS}
        cases[ws]["exclude_frozen"] = (_exclude_frozen,)
        cases[ws]["lora_exclude_frozen"] = (_lora_exclude_frozen,)
    return SharedRuns(cases)


def _consolidated(rank, world_size, stage, precision):
    """Trained two steps, without the gather flag; the dict, the full state dict and the stats."""
    import zeroshard
    from zeroshard import _C

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, stage, precision))
    _train(model, engine, rank, world_size, range(2))
    state = engine.consolidated_state_dict()
    full = engine.full_state_dict()
    stats = _C._consolidated_16bit_state_dict(engine._core, [])
    del stats["state_dict"]
    units = [padded_numel(u["numel"], world_size) for u in engine.stage3_units()]
    tied = None if state is None else state[TIED[0]] is state[TIED[1]]
    # The engine trains on afterwards: nothing was left gathered or changed.
    losses = _train(model, engine, rank, world_size, range(2, 3))
    return dict(state=state, full=full, stats=stats, units=units, tied=tied, losses=losses,
                held=engine.memory_stats()["params"])


def _exclude_frozen(rank, world_size):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 3, "bf16"))
    _train(model, engine, rank, world_size, range(1))
    return engine.consolidated_state_dict(exclude_frozen_parameters=True), engine.full_state_dict()


def _lora_exclude_frozen(rank, world_size):
    """A LoRA model at stage 3, as the Trainer saves a peft model: the adapters only, and the frozen
    base is not gathered for them (the peak is the largest unit's trained parameters)."""
    import zeroshard
    from zeroshard import _C

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    engine = zeroshard.initialize(model, engine_config(3, zero={"stage3_param_persistence_threshold": 30}))
    train_global_batches(model, engine, rank, world_size, range(1))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    stats = _C._consolidated_16bit_state_dict(engine._core, frozen)
    with engine.gathered_parameters():
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trained_units = [padded_numel(u["numel"], world_size) * 4 for u in engine.stage3_units()]
    return dict(state=engine.consolidated_state_dict(exclude_frozen_parameters=True), stats=stats,
                adapters=adapters, trained_units=trained_units)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rank_0_gets_the_full_state_dict_and_the_others_none(runs, world_size, stage, precision):
    results = runs.result(world_size, f"stage{stage}_{precision}")
    out = results[0]
    state, full = out["state"], out["full"]
    assert type(state).__name__ == "OrderedDict"
    assert list(state) == list(full)  # every name, the tied one included, in the module's order
    for name, value in full.items():
        assert state[name].device.type == "cpu" and state[name].dtype == value.dtype, name
        assert torch.equal(state[name], value), name
    assert state["embed.weight"].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert state["temperature"].dtype == torch.float32 and state["steps"].dtype == torch.long
    assert out["tied"] is True  # one tensor under both names, as in module.state_dict()
    assert out["stats"]["tensors"] == len(full) - 1
    for rank, other in enumerate(results[1:], start=1):
        assert other["state"] is None, rank
        assert other["losses"] == out["losses"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage_3_gathers_one_unit_at_a_time_and_releases_it(runs, world_size, precision):
    for out in runs.result(world_size, f"stage3_{precision}"):
        assert len(out["units"]) == 3  # blocks.0, blocks.1 and the root
        assert out["stats"]["gathered_peak"] == BYTES[precision] * max(out["units"])
        assert out["stats"]["gathered_peak"] < BYTES[precision] * sum(out["units"])
    for stage in (1, 2):  # whole already: nothing gathered
        assert [r["stats"]["gathered_peak"] for r in runs.result(world_size, f"stage{stage}_{precision}")] == \
            [0] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exclude_frozen_parameters_leaves_out_exactly_the_frozen_ones(runs, world_size):
    results = runs.result(world_size, "exclude_frozen")
    state, full = results[0]
    assert list(state) == [name for name in full if name != "frozen"]
    for name, value in state.items():
        assert torch.equal(value, full[name]), name
    assert all(r[0] is None for r in results[1:])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_lora_models_adapters_come_without_gathering_the_base(runs, world_size):
    results = runs.result(world_size, "lora_exclude_frozen")
    out = results[0]
    assert list(out["state"]) == list(out["adapters"])
    for name, value in out["adapters"].items():
        assert torch.equal(out["state"][name], value), name
    for r in results:
        assert r["stats"]["gathered_peak"] == max(r["trained_units"])
