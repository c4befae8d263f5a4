"""bf16 at every stage: bf16 parameters, gradients and gathers, fp32 master weights and AdamW.

The reference is the same recipe in plain torch in one process: a bf16 copy of the model
computes the loss and gradients, an fp32 master copy takes the AdamW step, and the bf16 copy is
refreshed from it. At one rank the engine does exactly that (the bf16 losses must agree to
rounding); the parameters are compared at bf16's tolerance (2%, since bf16 kernels round
differently on differently aligned buffers and AdamW turns near-zero gradients into full-size
steps). test_small_updates_accumulate_in_the_fp32_master checks the master itself.

The cases share one spawned run per world size (spawn.SharedRuns), each with its own result and
failure.
"""

import pytest
import torch

from conftest import WORLD_SIZES
from model_state import model_state_bytes, padded_numel, param_numel, stage3_unit_numels
from models import global_batch, make_model
from spawn import SharedRuns
from training import MICRO, adamw_reference, engine_config, train_global_batches

STEPS = 4


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {"stages": (_train,)} for ws in WORLD_SIZES}
    cases[1] |= {f"tiny_steps_stage{stage}": (_tiny_steps, stage) for stage in (0, 2, 3)}
    cases[2] |= {f"reduce_dtype_stage{stage}_{dtype}": (_reduce_dtype, stage, dtype)
                 for stage in (0, 1, 2, 3) for dtype in ("fp32", "compute")}
    cases[2]["accumulating"] = (_accumulating,)
    cases[2] |= {"state_dicts_bf16": (_state_dicts, True), "state_dicts_fp32": (_state_dicts, False)}
    for ws in (2, 4):
        cases[ws]["fp32_sums"] = (_fp32_sums,)
    return SharedRuns(cases)


def _config(stage, precision="bf16"):
    return engine_config(stage, precision=precision, zero={"stage3_param_persistence_threshold": 0})


def _train(rank, world_size):
    import torch.distributed as dist
    import zeroshard

    results = {}
    for stage in (0, 1, 2, 3):
        model = make_model()
        initial = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        engine = zeroshard.initialize(model, _config(stage))
        start = engine.full_state_dict()
        assert all(v.dtype == torch.bfloat16 for v in start.values())
        assert all(torch.equal(start[k], initial[k]) for k in initial)
        losses = []
        for step in range(STEPS):
            tokens = global_batch(step, MICRO * world_size)
            loss = model.loss(tokens[rank * MICRO:(rank + 1) * MICRO])
            assert loss.dtype == torch.bfloat16
            engine.backward(loss)
            engine.step()
            total = loss.detach().float()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
        results[stage] = (losses, engine.full_state_dict(), engine.memory_stats())
    return results


def _assert_bf16_close(actual, expected, what):
    """Elementwise within bf16's tolerance for all but 1% of the elements (AdamW can turn a
    near-zero gradient that rounds differently into a full-size step), and the whole tensor
    within 2% in L2."""
    a, e = actual.float(), expected.float()
    off = (a - e).abs() > 2e-3 + 2e-2 * e.abs()
    assert off.sum().item() <= max(1, 0.01 * off.numel()), f"{what}: {int(off.sum())} of {off.numel()} elements differ"
    assert (a - e).norm() <= 0.02 * e.norm() + 1e-3, f"{what}: relative L2 difference {(a - e).norm() / e.norm():.4f}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_stages_follow_the_fp32_master_recipe(runs, world_size):
    results = runs.result(world_size, "stages")[0]
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * world_size, precision="bf16")
    exact = world_size == 1
    for stage, (losses, state, _) in results.items():
        assert losses == pytest.approx(ref_losses, rel=1e-3 if exact else 1e-2), f"stage {stage}"
        for name, ref in ref_state.items():
            assert state[name].dtype == torch.bfloat16
            _assert_bf16_close(state[name], ref, f"stage {stage}, {name}")
    # Stages agree with each other.
    for stage in (1, 2, 3):
        for name, value in results[0][1].items():
            _assert_bf16_close(results[stage][1][name], value, f"stage {stage} vs 0, {name}")


def test_bf16_memory_follows_the_mixed_precision_formulas(runs):
    """Per rank: 2-byte params and grads, fp32 master + exp_avg + exp_avg_sq (12 bytes).
    stage 0: 16Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N, Ψ counting the
    padding of every bucket or unit. (With accumulation the gradient shard is fp32:
    test_accumulating_gradient_shards_are_fp32.)"""
    world_size = 2
    results = runs.result(world_size, "stages")  # the run test_bf16_stages_follow_... checks too
    model = make_model()
    padded = padded_numel(param_numel(model), world_size)
    for rank_results in results:
        for stage in (0, 1, 2):
            mem = rank_results[stage][2]
            expected = model_state_bytes(stage, world_size, padded, "bf16")
            assert {k: mem[k] for k in expected} == expected, (stage, mem)
    # Stage 3 units are the two blocks and the root, each padded on its own; exp_avg + exp_avg_sq
    # cover every padded element once across ranks, as the master copy does.
    expected = model_state_bytes(3, world_size, sum(stage3_unit_numels(model, world_size)), "bf16")
    for rank_results in results:
        mem = rank_results[3][2]
        assert {k: mem[k] for k in expected} == expected, mem


def _tiny_steps(rank, world_size, stage):
    import zeroshard

    model = make_model()
    config = _config(stage)
    config["optimizer"]["params"].update(lr=2e-4, weight_decay=0.0)
    engine = zeroshard.initialize(model, config)
    before = engine.full_state_dict()["head.weight"].float()
    tokens = global_batch(0, MICRO)
    engine.backward(model.loss(tokens))
    engine.step()
    after_one = engine.full_state_dict()["head.weight"].float()
    for _ in range(40):
        engine.backward(model.loss(tokens))
        engine.step()
    after_many = engine.full_state_dict()["head.weight"].float()
    big = before.abs() > 0.1  # bf16 spacing there is >= 2^-11, above one step of 2e-4
    return (after_one[big] != before[big]).float().mean().item(), (after_many[big] != before[big]).float().mean().item()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_small_updates_accumulate_in_the_fp32_master(runs, stage):
    """An AdamW step of 2e-4 is below half a bf16 ulp for weights above 0.1 in magnitude: a
    master kept in bf16 would round every step away and never move them; the fp32 master
    accumulates the steps until most of them move."""
    moved_once, moved_later = runs.result(1, f"tiny_steps_stage{stage}")[0]
    assert moved_later > 0.5 and moved_later > moved_once


def _reduce_dtype(rank, world_size, stage, reduce_dtype):
    import zeroshard

    model = make_model()
    config = _config(stage)
    config["zeroshard"]["reduce_dtype"] = reduce_dtype
    engine = zeroshard.initialize(model, config)
    train_global_batches(model, engine, rank, world_size, range(STEPS))
    return engine.comm_stats(), engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_dtype_fp32_sums_gradients_in_fp32(runs, stage):
    """zeroshard.reduce_dtype = "fp32" puts fp32 on the wire for gradients (twice the bytes of
    the bf16 default) while parameters are still gathered in bf16, and trains the same."""
    world_size = 2
    wide = runs.result(world_size, f"reduce_dtype_stage{stage}_fp32")[0]
    narrow = runs.result(world_size, f"reduce_dtype_stage{stage}_compute")[0]
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    assert wide[0][kind]["bytes"] == 2 * narrow[0][kind]["bytes"] > 0
    assert wide[0]["all_gather"]["bytes"] == narrow[0]["all_gather"]["bytes"]
    for name, value in narrow[1].items():
        _assert_bf16_close(wide[1][name], value, f"stage {stage}, {name}")


def _accumulating(rank, world_size):
    import zeroshard

    model = make_model()
    config = _config(2)
    config["gradient_accumulation_steps"] = 2
    engine = zeroshard.initialize(model, config)
    train_global_batches(model, engine, rank, world_size, range(1))
    return engine.memory_stats()["grads"], engine.memory_stats()["params"]


def test_accumulating_gradient_shards_are_fp32(runs):
    """Accumulating micro-batches in a 16-bit shard would round every addition: with
    gradient_accumulation_steps > 1 the stage-2 gradient shard is fp32 (4Ψ/N bytes)."""
    grads, params = runs.result(2, "accumulating")[0]
    assert grads == model_state_bytes(2, 2, params // 2, "bf16", fp32_grad_shard=True)["grads"]


def _fp32_sums(rank, world_size):
    import zeroshard

    results = {}
    for stage in (1, 2, 3):
        model = make_model()
        config = _config(stage)
        config["zeroshard"]["reduce_dtype"] = "fp32"
        engine = zeroshard.initialize(model, config)
        train_global_batches(model, engine, rank, world_size, range(STEPS))
        results[stage] = (engine.full_state_dict(dtype=torch.float32), engine.full_state_dict(),
                          engine.memory_stats())
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp32_sums_give_bitwise_the_same_weights_at_stages_1_2_3(runs, world_size):
    """bf16 with reduce_dtype "fp32": every stage hands AdamW the unrounded fp32 sum of the
    ranks' bf16 gradients (stage 1 reduce-scatters into an fp32 gradient shard, as stages 2 and
    3 do), so the fp32 master weights, and the bf16 parameters cast from them, are bitwise
    equal across stages. Stage 1 pays 4 bytes per element of its shard for it."""
    results = runs.result(world_size, "fp32_sums")
    for rank, by_stage in enumerate(results):
        master1, params1, _ = by_stage[1]
        for stage in (2, 3):
            master, params, _ = by_stage[stage]
            for name in master1:
                assert torch.equal(master[name], master1[name]), f"rank {rank}, stage {stage} vs 1, master {name}"
                assert torch.equal(params[name], params1[name]), f"rank {rank}, stage {stage} vs 1, {name}"
        mem = by_stage[1][2]
        padded = mem["params"] // 2
        assert mem["grads"] == model_state_bytes(1, world_size, padded, "bf16", fp32_grad_shard=True)["grads"]


def _state_dicts(rank, world_size, bf16):
    import zeroshard

    results = {}
    for stage in (0, 1, 2, 3):
        model = make_model()
        engine = zeroshard.initialize(model, _config(stage, "bf16" if bf16 else "fp32"))
        train_global_batches(model, engine, rank, world_size, range(STEPS))
        step_traffic = engine.comm_stats()
        results[stage] = (engine.full_state_dict(), engine.full_state_dict(dtype=torch.float32),
                          engine.full_state_dict(dtype=torch.float16, rank0_only=True),
                          engine.comm_stats() == step_traffic)
    return results


def test_full_state_dict_in_fp32_is_the_master_weights(runs):
    """full_state_dict(dtype=torch.float32) gathers the fp32 master weights under the model's
    names, at every stage: with bf16 the bf16 parameters are exactly their rounding, yet they
    hold more than bf16 does; in fp32 training they are the parameters. Other dtypes are casts
    of them, and the gathers are not training traffic (comm_stats is the last step's)."""
    bf16 = runs.result(2, "state_dicts_bf16")
    fp32 = runs.result(2, "state_dicts_fp32")
    for stage in (0, 1, 2, 3):
        for rank in range(2):
            params, master, half, uncounted = bf16[rank][stage]
            what = f"stage {stage}, rank {rank}"
            assert params.keys() == master.keys()
            assert half == {} if rank else half.keys() == master.keys()
            finer = 0
            for name, value in master.items():
                assert value.dtype == torch.float32 and value.shape == params[name].shape, f"{what}, {name}"
                assert torch.equal(value.to(torch.bfloat16), params[name]), f"{what}, {name}"
                finer += int((value != params[name].float()).sum())
                if rank == 0:
                    assert torch.equal(half[name], value.to(torch.float16)), f"{what}, {name}"
            assert finer > 0, f"{what}: the fp32 state dict is only the bf16 one widened"
            assert uncounted, f"{what}: the gathers were counted as the last step's traffic"
            params32, master32, _, _ = fp32[rank][stage]
            for name, value in params32.items():
                assert torch.equal(master32[name], value), f"{what}, fp32, {name}"
