"""Hybrid sharding (zeroshard.shard_group_size / zero_optimization.mics_shard_size): 4 ranks as 2
shard groups of 2. States are sharded inside a group and replicated across the groups; gradients
are reduce-scattered in the group, then each shard is all-reduced across the groups.

Held to single-process torch.optim.AdamW on the same global batch at stages 1-3, fp32 (with
accumulation and clipping) and bf16 (the fp32-master recipe, bf16's tolerance), and to the
memory formulas with the group's size in place of the world's. The cases share one spawned run
(spawn.SharedRuns).
"""

import pytest
import torch

from model_state import model_state_bytes, stage3_unit_numels
from models import make_model
from spawn import SharedRuns
from training import MICRO, adamw_reference, assert_like_adamw, engine_config, train_global_batches

STEPS = 4
RTOL, ATOL = 1e-4, 1e-5
WORLD, GROUP = 4, 2


def _config(stage, precision, gas=None, clip=None, key="shard_group_size"):
    config = engine_config(stage, precision=precision, gas=gas, clip=clip,
                           zero={"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0})
    if key == "mics_shard_size":
        config["zero_optimization"]["mics_shard_size"] = GROUP
    else:
        config["zeroshard"]["shard_group_size"] = GROUP
    return config


def _train(rank, world_size, precision, gas, clip):
    import zeroshard

    out = {}
    for stage in (1, 2, 3):
        model = make_model()
        engine = zeroshard.initialize(model, _config(stage, precision, gas, clip,
                                                     key="mics_shard_size" if stage == 2 else "shard_group_size"))
        losses = train_global_batches(model, engine, rank, world_size, range(STEPS), MICRO)
        out[stage] = {"losses": losses, "memory": engine.memory_stats(), "comm": engine.comm_stats(),
                      "plan": engine.plan(), "state": engine.full_state_dict()}
    return out


CASES = {"fp32": ("fp32", None, None), "fp32_accumulation_clipping": ("fp32", 2, 0.05), "bf16": ("bf16", None, None)}


def _errors(rank, world_size):
    """What hybrid sharding refuses, each with an error that names it."""
    import zeroshard

    out = {}
    for name, stage, size in (("stage0", 0, 2), ("not_a_divisor", 2, 3)):
        config = engine_config(stage)
        config["zeroshard"]["shard_group_size"] = size
        try:
            zeroshard.initialize(make_model(), config)
        except ValueError as e:
            out[name] = str(e)
    # Ranks given different configs: the first two shard in pairs, the others over the world.
    config = engine_config(2)
    if rank < 2:
        config["zeroshard"]["shard_group_size"] = GROUP
    try:
        zeroshard.initialize(make_model(), config)
    except RuntimeError as e:
        out["disagree"] = str(e)
    return out


SAVE_AT, MORE = 2, 2


def _layout(stage, group):
    config = _config(stage, "fp32")
    if group is None:
        del config["zeroshard"]["shard_group_size"]
    else:
        config["zeroshard"]["shard_group_size"] = group
    return config


def _checkpoints(rank, world_size, tmp):
    """Saved at 2x2 (stages 2 and 3) after SAVE_AT steps; resumed in new engines at 2x2, at 1x4
    (one group of 4) and at 4x1 (groups of 1: every rank holds everything), the weights after
    MORE steps against the run that went on."""
    import zeroshard
    from models import make_stateful_model

    out = {}
    for stage in (2, 3):
        path = f"{tmp}/stage{stage}"
        model = make_stateful_model(0)
        engine = zeroshard.initialize(model, _layout(stage, GROUP))
        train_global_batches(model, engine, rank, world_size, range(SAVE_AT), MICRO, after_step=model.advance)
        engine.save_checkpoint(path)
        train_global_batches(model, engine, rank, world_size, range(SAVE_AT, SAVE_AT + MORE), MICRO,
                             after_step=model.advance)
        out[stage, "uninterrupted"] = engine.full_state_dict(dtype=torch.float32)
        for name, (resume_stage, group) in {"2x2": (stage, GROUP), "1x4": (2, None), "4x1": (3, 1)}.items():
            model = make_stateful_model(seed=7)
            engine = zeroshard.initialize(model, _layout(resume_stage, group))
            engine.load_checkpoint(path)
            train_global_batches(model, engine, rank, world_size, range(SAVE_AT, SAVE_AT + MORE), MICRO,
                                 after_step=model.advance)
            out[stage, name] = engine.full_state_dict(dtype=torch.float32)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_saved_at_2x2_resume_at_any_layout(runs, stage):
    for by_case in runs.result(WORLD, "checkpoints"):
        uninterrupted = by_case[stage, "uninterrupted"]
        same = by_case[stage, "2x2"]
        assert all(torch.equal(same[k], v) for k, v in uninterrupted.items()), "2x2 resume is not the same run"
        for layout in ("1x4", "4x1"):
            for name, value in uninterrupted.items():
                torch.testing.assert_close(by_case[stage, layout][name], value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{layout}, {name}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {name: (_train, *args) for name, args in CASES.items()}
    cases["errors"] = (_errors,)
    cases["checkpoints"] = (_checkpoints, str(tmp_path_factory.mktemp("hybrid_ckpt")))
    return SharedRuns({WORLD: cases})


def test_what_hybrid_sharding_refuses_is_named(runs):
    for errors in runs.result(WORLD, "errors"):
        assert "needs zero_optimization.stage 1, 2 or 3" in errors["stage0"]
        assert "a shard group of 3 ranks does not divide the world of 4 ranks" in errors["not_a_divisor"]
    # Every rank names the first rank whose plan differs from its own, at initialize.
    for rank, errors in enumerate(runs.result(WORLD, "errors")):
        mine, other = ("shard groups of 2", "shard groups of 4") if rank < 2 else ("shard groups of 4",
                                                                                  "shard groups of 2")
        assert "the ranks planned different layouts" in errors["disagree"], errors["disagree"]
        assert f"rank {rank} has stage 2, {mine}, hpZ off but rank {2 if rank < 2 else 0} has stage 2, {other}" \
            in errors["disagree"], errors["disagree"]



@pytest.mark.parametrize("case", sorted(CASES))
def test_two_groups_of_two_train_like_single_process_adamw(runs, case):
    precision, gas, clip = CASES[case]
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * WORLD * (gas or 1), clip=clip or 0.0,
                                            precision=precision)
    results = runs.result(WORLD, case)
    for stage in (1, 2, 3):
        result = results[0][stage]
        assert_like_adamw(result, ref_losses, ref_state, precision, f"stage {stage}", RTOL, ATOL)
        # Every rank ends with the same weights: the groups' copies agree.
        for other in results[1:]:
            for name, value in result["state"].items():
                assert torch.equal(other[stage]["state"][name], value), (stage, name)


def test_memory_follows_the_formulas_with_the_group_in_place_of_the_world(runs):
    model = make_model()
    results = runs.result(WORLD, "bf16")
    for rank_results in results:
        for stage in (1, 2):
            mem = rank_results[stage]["memory"]
            # Several buckets (reduce_bucket_size 700), each padded for the group: the whole
            # bf16 parameters count them, and the sharded states are a group's share of them.
            expected = model_state_bytes(stage, GROUP, mem["params"] // 2, "bf16")
            assert {k: mem[k] for k in expected} == expected, (stage, mem)
        expected = model_state_bytes(3, GROUP, sum(stage3_unit_numels(model, GROUP)), "bf16")
        mem = rank_results[3]["memory"]
        assert {k: mem[k] for k in expected} == expected, mem


def test_bytes_per_step_by_level_follow_the_formulas(runs):
    """Stages 1 and 2, fp32, one micro-batch per step, Ψ the padded elements of every bucket:
    inside the group the gradients are reduce-scattered and the parameters all-gathered (4Ψ
    bytes each); across the groups only each shard's all-reduce moves (4Ψ/k, counted twice as
    traffic, Note [traffic]). The levels add up to the step's total."""
    for rank_results in runs.result(WORLD, "fp32"):
        for stage in (1, 2):
            comm, padded = rank_results[stage]["comm"], rank_results[stage]["memory"]["params"] // 4
            intra, inter = comm["intra"], comm["inter"]
            assert intra["reduce_scatter"]["bytes"] == 4 * padded and intra["all_gather"]["bytes"] == 4 * padded
            assert intra["all_reduce"]["bytes"] == 0 and inter["reduce_scatter"]["bytes"] == 0
            assert inter["all_reduce"]["bytes"] == 4 * padded // GROUP
            assert inter["all_gather"]["bytes"] == 0
            assert intra["traffic_bytes"] + inter["traffic_bytes"] == comm["traffic_bytes"]
            assert inter["traffic_bytes"] == 2 * 4 * padded // GROUP


def test_the_plan_names_the_groups(runs):
    plan = runs.result(WORLD, "fp32")[0][3]["plan"]
    assert plan.splitlines()[0] == ("parameters: sharded over ranks 0-1 (2 shards) in each of 2 groups of "
                                    "consecutive ranks (2 copies of each shard), on cpu")
