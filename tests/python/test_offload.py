"""ZeRO-Offload: optimizer state (stages 1-3) and stage-3 parameter shards in host memory.

Offload must not change the numbers: every offloaded run gives bitwise the same fp32 master
weights and compute-dtype parameters as the same run without it, at stages 1-3, fp32, bf16 and
fp16, 1/2/4 ranks. On this CPU-only machine the host and the compute device are the same
memory, yet the offloaded path runs with buffers of its own (host masters, host gradient
shards, host parameter shards) and every copy, so what is compared is the offloaded code.
memory_stats() splits every state by place, held to model_state.offloaded_state_bytes exactly.

The cases share one spawned run per world size (spawn.SharedRuns), each with its own result and
failure; the checkpoint cases save in one set of runs and resume in another.
"""

import pytest
import torch

from conftest import WORLD_SIZES
from model_state import offloaded_state_bytes, stage3_unit_numels
from models import global_batch, make_model, make_stateful_model
from spawn import SharedRuns
from training import MICRO, engine_config, train_global_batches

STEPS = 3
OPTIMIZER = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
PARAMS = {"offload_param": {"device": "cpu", "pin_memory": True}}
# What each stage offloads in the bitwise cases: the optimizer, and at stage 3 also the
# parameters, and the parameters alone.
VARIANTS = {1: {"opt": OPTIMIZER}, 2: {"opt": OPTIMIZER},
            3: {"opt": OPTIMIZER, "opt+param": OPTIMIZER | PARAMS, "param": PARAMS}}
# fp32 accumulates two micro-batches (an fp32 gradient shard) and clips; bf16 clips and reduces
# one micro-batch into a bf16 shard, converted to fp32 on the way to the host.
RECIPES = {"fp32": {"gas": 2, "clip": 0.05}, "bf16": {"gas": None, "clip": 0.05}}


def _config(stage, precision, offload=None, gas=None, clip=None, **zero):
    # Small buckets: several buckets at stages 1-2, so that the per-bucket host step, copy back
    # and all-gather run in a pipeline; threshold 0: every stage-3 parameter is sharded.
    return engine_config(stage, precision=precision, gas=gas, clip=clip,
                         zero={"reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0,
                               **(offload or {}), **zero})


def _run(rank, world_size, config, skips=False):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, config)
    if skips:  # fp16: a step may be skipped, so engine.step() is not always True at a boundary
        losses = []
        for step in range(STEPS + 2):
            tokens = global_batch(step, MICRO * world_size)
            loss = model.loss(tokens[rank * MICRO:(rank + 1) * MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    else:
        losses = train_global_batches(model, engine, rank, world_size, range(STEPS))
    return {"losses": losses, "master": engine.full_state_dict(dtype=torch.float32),
            "params": engine.full_state_dict(), "memory": engine.memory_stats(), "plan": engine.plan(),
            "skipped": engine.skipped_steps, "scale": engine.loss_scale}


def _bitwise(rank, world_size, stage, precision):
    recipe = RECIPES[precision]
    out = {"none": _run(rank, world_size, _config(stage, precision, **recipe))}
    for name, offload in VARIANTS[stage].items():
        out[name] = _run(rank, world_size, _config(stage, precision, offload, **recipe))
    return out


def _fp16(rank, world_size):
    # A small initial scale and window: the run overflows and skips, then grows the scale.
    config = engine_config(2, precision="fp16", loss_scaling={"initial_scale_power": 30, "loss_scale_window": 2},
                           zero={"reduce_bucket_size": 2000})
    plain = _run(rank, world_size, config, skips=True)
    config["zero_optimization"] |= OPTIMIZER
    return {"none": plain, "opt": _run(rank, world_size, config, skips=True)}


def _partial(rank, world_size, stage):
    ratio = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    return {"none": _run(rank, world_size, _config(stage, "bf16")),
            "half": _run(rank, world_size, _config(stage, "bf16", ratio))}


def _meta(rank, world_size, stage, precision, offload):
    """A model built on the meta device, initialised into offloaded storage, against the same
    model built normally without offload."""
    import zeroshard
    from test_meta_init import build, config

    out = {}
    for meta in (False, True):
        model = build(meta)
        cfg = config(stage, precision)
        if meta:
            cfg["zero_optimization"] |= offload
        engine = zeroshard.initialize(model, cfg)
        start = engine.full_state_dict(dtype=torch.float32)
        train_global_batches(model, engine, rank, world_size, range(2))
        out[meta] = {"start": start, "master": engine.full_state_dict(dtype=torch.float32),
                     "params": engine.full_state_dict(), "host": engine.memory_stats()["host_total"]}
    return out


def _one_thread(rank, world_size):
    """The host AdamW runs on torch's intra-op threads: with one of them (torchrun's default
    OMP_NUM_THREADS=1) on a host with more cores, rank 0 says so; with two it does not."""
    import warnings

    import zeroshard

    before = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                zeroshard.initialize(make_model(), _config(1, "fp32", OPTIMIZER))
            out[threads] = [str(w.message) for w in caught if "intra-op threads" in str(w.message)]
    finally:
        torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {f"stage{stage}_{precision}": (_bitwise, stage, precision)
                  for stage in (1, 2, 3) for precision in ("fp32", "bf16")} for ws in WORLD_SIZES}
    cases[1]["one_thread"] = (_one_thread,)
    cases[2] |= {"fp16": (_fp16,), "partial_stage2": (_partial, 2), "partial_stage3": (_partial, 3),
                 "meta_stage3": (_meta, 3, "bf16", OPTIMIZER | PARAMS), "meta_stage1": (_meta, 1, "fp32", OPTIMIZER)}
    return SharedRuns(cases)


def _assert_same(actual, expected, what):
    for key in ("master", "params"):
        assert actual[key].keys() == expected[key].keys()
        for name, value in expected[key].items():
            assert actual[key][name].dtype == value.dtype, f"{what}: {key} {name}"
            assert torch.equal(actual[key][name], value), f"{what}: {key} {name} differs"
    assert actual["losses"] == expected["losses"], what


def _padded_elements(plain, stage, precision, world_size):
    """Padded elements of every bucket or unit, from the run without offload (whose bytes
    test_engine*.py and test_mixed_precision.py hold to the formulas)."""
    per_param = 4 if precision == "fp32" else 2
    return plain["memory"]["params"] // per_param * (world_size if stage == 3 else 1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_offloaded_runs_are_bitwise_the_runs_without_offload(runs, world_size, stage, precision):
    for rank, result in enumerate(runs.result(world_size, f"stage{stage}_{precision}")):
        for name in VARIANTS[stage]:
            _assert_same(result[name], result["none"], f"rank {rank}, {name}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_by_place_follows_the_offload_formulas(runs, world_size, stage, precision):
    """E.g. bf16 stage 2 with the optimizer offloaded: on the device 2Ψ of parameters and 2Ψ/N
    of gradient shard, on the host 12Ψ/N of optimizer state and the 4Ψ/N fp32 gradient shard
    the host step reads; the all-places keys are the sums."""
    for result in runs.result(world_size, f"stage{stage}_{precision}"):
        elements = _padded_elements(result["none"], stage, precision, world_size)
        for name, offload in VARIANTS[stage].items():
            mem = result[name]["memory"]
            expected = offloaded_state_bytes(stage, world_size, elements, precision,
                                             optimizer="offload_optimizer" in offload,
                                             params="offload_param" in offload)
            assert {k: mem[k] for k in expected} == expected, (name, mem)
            for state in ("params", "grads", "optimizer", "total"):
                assert mem[state] == mem[f"host_{state}"] + mem[f"device_{state}"], (name, state, mem)
        assert result["none"]["memory"]["host_total"] == 0


def test_one_intra_op_thread_for_the_host_step_is_warned_about(runs):
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: one thread is all there is")
    result = runs.result(1, "one_thread")[0]
    assert len(result[1]) == 1 and "torch.set_num_threads" in result[1][0], result
    assert result[2] == []


def test_the_plan_says_what_is_in_host_memory(runs):
    result = runs.result(2, "stage3_bf16")[0]
    assert result["none"]["plan"].count("in host memory") == 0
    assert result["opt"]["plan"].splitlines()[2].endswith("optimizer state: sharded over ranks 0-1 (2 shards), "
                                                          "in host memory")
    assert result["opt+param"]["plan"].splitlines()[0].endswith("in host memory")
    assert result["param"]["plan"].count("in host memory") == 1


def test_fp16_offload_skips_and_scales_as_without(runs):
    for result in runs.result(2, "fp16"):
        assert result["none"]["skipped"] >= 1, "the initial scale is meant to overflow"
        assert (result["opt"]["skipped"], result["opt"]["scale"]) == (result["none"]["skipped"], result["none"]["scale"])
        _assert_same(result["opt"], result["none"], "fp16")


@pytest.mark.parametrize("stage", [2, 3])
def test_partial_offload_keeps_the_last_buckets_on_the_host(runs, stage):
    """offload_optimizer.ratio 0.5: of n buckets (units at stage 3), those from int(0.5 n) on
    are stepped on the host, the others on the device; the numbers do not change."""
    world_size = 2
    model = make_model()
    for result in runs.result(world_size, f"partial_stage{stage}"):
        _assert_same(result["half"], result["none"], f"stage {stage}")
        mem = result["half"]["memory"]
        if stage == 3:
            units = stage3_unit_numels(model, world_size)
        else:  # the buckets' padded sizes are not at hand: split the total by the host share
            units = None
        if units is not None:
            host = units[int(0.5 * len(units)):]
            assert mem["host_optimizer"] == 12 * sum(host) // world_size, mem
            assert mem["device_optimizer"] == 12 * (sum(units) - sum(host)) // world_size, mem
            assert mem["host_grads"] == 4 * sum(host) // world_size, mem
        assert 0 < mem["host_optimizer"] < mem["optimizer"], mem
        assert mem["optimizer"] == result["none"]["memory"]["optimizer"]
        assert "the last 50% of the buckets" in result["half"]["plan"]


@pytest.mark.parametrize("case", ["meta_stage3", "meta_stage1"])
def test_a_meta_device_model_initialises_into_offloaded_storage(runs, case):
    for result in runs.result(2, case):
        normal, meta = result[False], result[True]
        assert meta["host"] > 0 and normal["host"] == 0
        for key in ("start", "master", "params"):
            for name, value in normal[key].items():
                assert torch.equal(meta[key][name], value), (key, name)


# Checkpoints: offloaded state saves and loads like any other. Saved with and without offload
# at 2 ranks, stage 2; resumed at 1, 2 and 4 ranks, other stages, offload on or off.
SAVE_AT = 2
RESUME_STEPS = 2


def _ckpt_config(world_size, stage, offload):
    config = engine_config(stage, micro=8 // world_size, zero={"reduce_bucket_size": 2000,
                                                               "stage3_param_persistence_threshold": 0,
                                                               **(offload or {})})
    config["train_batch_size"] = 8
    return config


def _save(rank, world_size, ckpt, offload):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _ckpt_config(world_size, 2, offload))
    train_global_batches(model, engine, rank, world_size, range(SAVE_AT), micro=8 // world_size,
                         after_step=model.advance)
    engine.save_checkpoint(ckpt)
    train_global_batches(model, engine, rank, world_size, range(SAVE_AT, SAVE_AT + RESUME_STEPS),
                         micro=8 // world_size, after_step=model.advance)
    return engine.full_state_dict(dtype=torch.float32)


def _resume(rank, world_size, ckpt, stage, offload):
    import zeroshard

    model = make_stateful_model(seed=99)
    engine = zeroshard.initialize(model, _ckpt_config(world_size, stage, offload))
    engine.load_checkpoint(ckpt)
    train_global_batches(model, engine, rank, world_size, range(SAVE_AT, SAVE_AT + RESUME_STEPS),
                         micro=8 // world_size, after_step=model.advance)
    return engine.full_state_dict(dtype=torch.float32)


RESUMES = {  # name: (world size, stage, offload, saved with offload)
    "2x2_plain_from_offload": (2, 2, None, True),
    "2x2_offload_from_plain": (2, 2, OPTIMIZER, False),
    "4x3_offload_from_plain": (4, 3, OPTIMIZER | PARAMS, False),
    "4x3_plain_from_offload": (4, 3, None, True),
    "1x1_offload_from_offload": (1, 1, OPTIMIZER, True),
    "1x1_plain_from_plain": (1, 1, None, False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("offload_ckpts")


@pytest.fixture(scope="module")
def saves(ckpts):
    return SharedRuns({2: {"plain": (_save, str(ckpts / "plain"), None),
                           "offload": (_save, str(ckpts / "offload"), OPTIMIZER)}})


@pytest.fixture(scope="module")
def resumes(ckpts, saves):
    saves.result(2, "plain")
    saves.result(2, "offload")
    by_world = {}
    for name, (ws, stage, offload, from_offload) in RESUMES.items():
        by_world.setdefault(ws, {})[name] = (_resume, str(ckpts / ("offload" if from_offload else "plain")), stage,
                                             offload)
    return SharedRuns(by_world)


def test_offloaded_checkpoints_resume_anywhere_as_plain_ones(saves, resumes):
    # The two saving runs are the same run: offload changed nothing, saved state included.
    plain, offloaded = saves.result(2, "plain")[0], saves.result(2, "offload")[0]
    assert all(torch.equal(offloaded[k], v) for k, v in plain.items())
    # Resumed at the saving world size, offload switched either way: the uninterrupted run.
    for name in ("2x2_plain_from_offload", "2x2_offload_from_plain"):
        state = resumes.result(2, name)[0]
        assert all(torch.equal(state[k], v) for k, v in plain.items()), name
    # Elsewhere the sums differ from the saving run's, but offload on or off does not matter.
    for a, b in (("4x3_offload_from_plain", "4x3_plain_from_offload"),
                 ("1x1_offload_from_offload", "1x1_plain_from_plain")):
        ws = RESUMES[a][0]
        left, right = resumes.result(ws, a)[0], resumes.result(ws, b)[0]
        assert all(torch.equal(left[k], v) for k, v in right.items()), (a, b)
        assert all(torch.allclose(left[k], v, rtol=1e-4, atol=1e-5) for k, v in plain.items()), a
