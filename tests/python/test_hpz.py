"""hpZ (zero_optimization.zero_hpz_partition_size, ZeRO++): 4 ranks, secondary groups of 2.

At stage 3 each unit released after its forward keeps this rank's half of the gathered unit (a
secondary shard over ranks {0, 1} or {2, 3}), and its backward gathers from those inside the
group instead of over the whole world. Nothing else changes, so a run with hpZ is held bitwise
to the same run without it, and both to single-process torch.optim.AdamW; the secondary shards'
bytes and each level's gathered bytes are held to formulas. Below stage 3 the key is ignored
with a warning (DeepSpeed's hpZ is stage 3's). The cases share one spawned run.
"""

import pytest
import torch

from model_state import model_state_bytes, stage3_unit_numels
from models import make_model
from spawn import SharedRuns
from training import MICRO, adamw_reference, assert_like_adamw, engine_config, train_global_batches

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5
WORLD, HPZ = 4, 2
ELEMENT = {"fp32": 4, "bf16": 2}


def _config(stage, precision, gas=None, clip=None, hpz=HPZ):
    zero = {"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0}
    if hpz is not None:
        zero["zero_hpz_partition_size"] = hpz
    return engine_config(stage, precision=precision, gas=gas, clip=clip, zero=zero)


def _run(model, engine, rank, world_size, warnings_seen):
    losses = train_global_batches(model, engine, rank, world_size, range(STEPS), MICRO)
    return {"losses": losses, "memory": engine.memory_stats(), "comm": engine.comm_stats(), "plan": engine.plan(),
            "state": engine.full_state_dict(), "warnings": warnings_seen}


def _train(rank, world_size, precision, gas, clip):
    import warnings

    import zeroshard

    out = {}
    for name, stage, hpz in (("stage1", 1, HPZ), ("stage2", 2, HPZ), ("stage3", 3, HPZ), ("stage3_flat", 3, None)):
        model = make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = zeroshard.initialize(model, _config(stage, precision, gas, clip, hpz))
        out[name] = _run(model, engine, rank, world_size, [str(w.message) for w in caught])
    return out


CASES = {"fp32": ("fp32", None, None), "fp32_accumulation_clipping": ("fp32", 2, 0.05), "bf16": ("bf16", None, None)}


def _recomputed(rank, world_size):
    """Stage 3 with every block under activation checkpointing (not reentrant): a block's
    forward runs again inside the backward, with grad, and gathers from the secondary shards
    too. With and without hpZ, and the losses of the same model without checkpointing."""
    import zeroshard
    from models import CheckpointedTransformer

    out = {}
    for name, hpz in (("hpz", HPZ), ("flat", None)):
        torch.manual_seed(0)  # as make_model()
        model = CheckpointedTransformer()
        engine = zeroshard.initialize(model, _config(3, "fp32", hpz=hpz))
        out[name] = _run(model, engine, rank, world_size, [])
    return out


def _errors(rank, world_size):
    """What hpZ refuses, each with an error that names it."""
    import zeroshard

    out = {}
    for name, zero in (("not_a_divisor", {"zero_hpz_partition_size": 3}),
                       ("with_mics", {"zero_hpz_partition_size": 2, "mics_shard_size": 2})):
        try:
            zeroshard.initialize(make_model(), engine_config(3, zero=zero))
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def runs():
    cases = {name: (_train, *args) for name, args in CASES.items()}
    cases["errors"] = (_errors,)
    cases["recomputed"] = (_recomputed,)
    return SharedRuns({WORLD: cases})


@pytest.mark.parametrize("case", sorted(CASES))
def test_hpz_trains_bitwise_like_stage3_without_it(runs, case):
    for rank_results in runs.result(WORLD, case):
        hpz, flat = rank_results["stage3"], rank_results["stage3_flat"]
        assert hpz["losses"] == flat["losses"]
        for name, value in flat["state"].items():
            assert torch.equal(hpz["state"][name], value), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_hpz_at_every_stage_trains_like_single_process_adamw(runs, case):
    precision, gas, clip = CASES[case]
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * WORLD * (gas or 1), clip=clip or 0.0,
                                            precision=precision)
    results = runs.result(WORLD, case)
    for stage in ("stage1", "stage2", "stage3"):
        result = results[0][stage]
        assert_like_adamw(result, ref_losses, ref_state, precision, stage, RTOL, ATOL)
        for other in results[1:]:
            for name, value in result["state"].items():
                assert torch.equal(other[stage]["state"][name], value), (stage, name)


def test_a_recomputed_forward_gathers_from_the_secondary_shards(runs):
    """Each block is gathered three times a step: the forward over the world, then inside the
    backward its recomputed forward and its backward from the secondary shards (the latter
    finds it gathered already, so one intra gather per block); bitwise the run without hpZ,
    and the uncheckpointed model's losses (recomputing changes no value)."""
    units = stage3_unit_numels(make_model(), WORLD)
    plain = runs.result(WORLD, "fp32")[0]["stage3_flat"]["losses"]
    for rank_results in runs.result(WORLD, "recomputed"):
        hpz, flat = rank_results["hpz"], rank_results["flat"]
        assert hpz["losses"] == flat["losses"] == plain
        for name, value in flat["state"].items():
            assert torch.equal(hpz["state"][name], value), name
        assert hpz["comm"]["intra"]["all_gather"]["bytes"] == 4 * sum(units[:-1])
        assert hpz["memory"]["secondary_peak"] == 4 * sum(units[:-1]) // HPZ


def test_below_stage3_the_key_is_ignored_with_a_warning(runs):
    rank_results = runs.result(WORLD, "fp32")[0]
    for stage in (1, 2):
        result = rank_results[f"stage{stage}"]
        assert any("zero_hpz_partition_size" in w and f"ignored at zero_optimization.stage {stage}" in w
                   for w in result["warnings"]), result["warnings"]
        assert "intra" not in result["comm"] and "hpZ" not in result["plan"]
    assert not any("hpz" in w for w in rank_results["stage3"]["warnings"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_secondary_shards_hold_half_of_every_released_unit(runs, precision):
    """The root unit (the last of stage3_unit_numels) stays gathered from its forward to its
    backward and keeps no secondary shard; every block keeps paddedNumel / HPZ elements in the
    compute dtype. The states held between steps are stage 3's over the whole world."""
    model = make_model()
    units = stage3_unit_numels(model, WORLD)
    for rank_results in runs.result(WORLD, precision):
        hpz, flat = rank_results["stage3"]["memory"], rank_results["stage3_flat"]["memory"]
        assert hpz["secondary_peak"] == ELEMENT[precision] * sum(units[:-1]) // HPZ
        assert flat["secondary_peak"] == 0
        expected = model_state_bytes(3, WORLD, sum(units), precision)
        assert {k: hpz[k] for k in expected} == expected
        assert {k: v for k, v in hpz.items() if k != "secondary_peak"} == \
            {k: v for k, v in flat.items() if k != "secondary_peak"}


def test_backward_gathers_stay_in_the_secondary_group(runs):
    """fp32, one micro-batch per step, bytes of full buffers (Note [traffic]): the forward gathers
    every unit over the world (4 bytes an element of Σ units), the backward gathers the blocks
    inside the group of 2 (4 Σ blocks), where without hpZ they crossed the world too. The
    reduce-scatters are unchanged, and so is the step's total: hpZ moves the blocks' backward
    gathers from the inter level to the intra one."""
    units = stage3_unit_numels(make_model(), WORLD)
    for rank_results in runs.result(WORLD, "fp32"):
        comm, flat = rank_results["stage3"]["comm"], rank_results["stage3_flat"]["comm"]
        intra, inter = comm["intra"], comm["inter"]
        assert inter["all_gather"]["bytes"] == 4 * sum(units)
        assert intra["all_gather"]["bytes"] == 4 * sum(units[:-1])
        assert intra["all_gather"]["calls"] == len(units) - 1
        assert flat["all_gather"]["bytes"] == inter["all_gather"]["bytes"] + intra["all_gather"]["bytes"]
        assert intra["reduce_scatter"]["bytes"] == 0
        assert inter["reduce_scatter"]["bytes"] == flat["reduce_scatter"]["bytes"] == 4 * sum(units)
        assert intra["traffic_bytes"] + inter["traffic_bytes"] == comm["traffic_bytes"] == flat["traffic_bytes"]
        assert flat["traffic_bytes"] - inter["traffic_bytes"] == 4 * sum(units[:-1])


def test_the_plan_says_hpz(runs):
    plan = runs.result(WORLD, "fp32")[0]["stage3"]["plan"]
    assert "hpZ" in plan.splitlines()[0] and "groups of 2 consecutive ranks" in plan.splitlines()[0]


def test_what_hpz_refuses_is_named(runs):
    for errors in runs.result(WORLD, "errors"):
        assert "zero_hpz_partition_size 3 does not divide the world of 4 ranks" in errors["not_a_divisor"]
        assert "set one of them" in errors["with_mics"] and "mics_shard_size" in errors["with_mics"]
