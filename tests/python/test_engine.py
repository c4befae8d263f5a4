"""Engine properties other than parity: exact memory and traffic per stage, and clear errors.

The cases share one spawned run per world size (spawn.SharedRuns), each with its own result and
failure.
"""

from pathlib import Path

import pytest
import torch

from conftest import WORLD_SIZES
from model_state import SHARD_ALIGNMENT, model_state_bytes, padded_numel, param_numel
from models import global_batch, make_model
from spawn import SharedRuns
from training import engine_config, train_global_batches


ONE_STEP = [(0, 1), (1, 1), (2, 1), (2, 2)]  # (stage, gradient_accumulation_steps)
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "zero2.json"


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {f"one_step_stage{stage}_gas{gas}": (_one_step, stage, gas) for stage, gas in ONE_STEP}
             for ws in WORLD_SIZES}
    cases[1]["from_file"] = (_from_file, str(SHIPPED_CONFIG))
    for ws in (2, 4):
        cases[ws]["gather_buckets"] = (_gather_buckets,)
    cases[2]["plans"] = (_plans,)
    cases[2]["errors"] = (_errors,)  # last: its engines stop in the middle of a step
    return SharedRuns(cases)


def _config(stage, gas=1):
    # One bucket for the whole model, so the padded size is known exactly.
    return engine_config(stage, lr=1e-3, weight_decay=None, gas=gas, zero={"reduce_bucket_size": 10**9})


def _one_step(rank, world_size, stage, gas):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, _config(stage, gas))
    train_global_batches(model, engine, rank, world_size, range(1))
    return param_numel(model), engine.memory_stats(), engine.comm_stats()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_and_traffic_follow_the_stage_formulas(runs, world_size):
    """Per-rank bytes: stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N (fp32: params and
    grads 4 bytes, exp_avg + exp_avg_sq 8; the fp32 params are the master weights). One step
    moves 2Ψ elements of traffic at every stage; Ψ is the padded size."""

    def check(stage, gas):
        results = runs.result(world_size, f"one_step_stage{stage}_gas{gas}")
        n = world_size
        for numel, mem, comm in results:
            padded = padded_numel(numel, n)
            assert 0 <= padded - numel < SHARD_ALIGNMENT * n
            psi = 4 * padded
            expected = model_state_bytes(stage, n, padded)
            assert {k: mem[k] for k in expected} == expected, (stage, mem)
            assert mem["total"] == sum(expected.values())
            # Traffic: stage 2 reduce-scatters every micro-batch, stages 0 and 1 once a step.
            reductions = gas if stage == 2 else 1
            if stage == 0:
                assert comm["all_reduce"] == {"calls": 1, "bytes": psi}
                assert comm["reduce_scatter"]["calls"] == comm["all_gather"]["calls"] == 0
            else:
                assert comm["reduce_scatter"] == {"calls": reductions, "bytes": reductions * psi}
                assert comm["all_gather"] == {"calls": 1, "bytes": psi}
                assert comm["all_reduce"]["calls"] == 0
            assert comm["broadcast"]["calls"] == 0
            assert comm["traffic_bytes"] == (1 + reductions) * psi

    for stage, gas in ONE_STEP:
        check(stage, gas)


def _gather_buckets(rank, world_size):
    import zeroshard

    results = {}
    for stage in (1, 2):
        for limit in (None, 1000, 10**9):
            model = make_model()
            config = _config(stage)
            if limit is not None:
                config["zero_optimization"]["allgather_bucket_size"] = limit
            engine = zeroshard.initialize(model, config)
            train_global_batches(model, engine, rank, world_size, range(2))
            results[stage, limit] = (engine.comm_stats()["all_gather"], engine.full_state_dict())
    return param_numel(make_model()), results


@pytest.mark.parametrize("world_size", [2, 4])
def test_allgather_bucket_size_bounds_each_parameter_gather(runs, world_size):
    """Stages 1 and 2 all-gather the updated parameters in calls of at most
    allgather_bucket_size elements: the one bucket of the model (padded to P elements) takes
    ceil(S / (limit // N)) calls for a shard of S = P / N, moving P x 4 bytes in all as one call
    would; the weights are bitwise those of one call per bucket."""
    numel, results = runs.result(world_size, "gather_buckets")[0]
    padded = padded_numel(numel, world_size)
    shard = padded // world_size
    for stage in (1, 2):
        _, reference = results[stage, None]
        for limit, calls in ((None, 1), (10**9, 1), (1000, -(-shard // (1000 // world_size)))):
            gathers, state = results[stage, limit]
            assert gathers == {"calls": calls, "bytes": 4 * padded}, f"stage {stage}, limit {limit}"
            for name, value in reference.items():
                assert torch.equal(state[name], value), f"stage {stage}, limit {limit}, {name}"


def _errors(rank, world_size):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, _config(2))
    with pytest.raises(RuntimeError, match=r"step\(\) called without engine.backward\(\)"):
        engine.step()
    tokens = global_batch(0, 2 * world_size)
    with pytest.raises(RuntimeError, match=r"instead of loss.backward\(\)"):
        model.loss(tokens[:2]).backward()
    with pytest.raises(RuntimeError, match="scalar loss"):
        engine.backward(model(tokens[:2]).sum(dim=-1))

    frozen = make_model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no trainable parameters"):
        zeroshard.initialize(frozen, _config(1))

    # train = micro x accumulation x world must hold for the group's world size.
    bad = _config(1)
    bad["train_batch_size"] = 2 * 2 * world_size + 2
    with pytest.raises(ValueError, match=rf"train_batch_size \({2 * 2 * world_size + 2}\) != .* world size \({world_size}\)"):
        zeroshard.initialize(make_model(), bad)

    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zeroshard.initialize(make_model(), _config(1), param_groups=[{"params": [stranger]}])
    partial = make_model()
    with pytest.raises(ValueError, match="are in no param group"):
        zeroshard.initialize(partial, _config(1), param_groups=[{"params": [partial.head.weight]}])
    with pytest.raises(ValueError, match="are in no param group"):
        zeroshard.initialize(partial, _config(1), param_groups=[])  # none given is not "all"
    with pytest.raises(ValueError, match=r"param group 0 has unknown keys \['momentum'\]"):
        zeroshard.initialize(partial, _config(1), param_groups=[{"params": partial.parameters(), "momentum": 0.9}])
    unknown_units = _config(3)
    unknown_units["zeroshard"]["stage3_unit_classes"] = ["NoSuchBlock"]
    with pytest.raises(ValueError, match=r"no module of class \['NoSuchBlock'\]"):
        zeroshard.initialize(make_model(), unknown_units)
    return True


def test_bad_input_gives_clear_errors(runs):
    assert runs.result(2, "errors") == [True, True]


def _from_file(rank, world_size, path):
    import zeroshard

    return zeroshard.initialize(make_model(), path).stage


def test_config_argument_accepts_a_shipped_file(runs):
    assert runs.result(1, "from_file") == [2]


def test_plain_python_says_once_that_it_runs_as_one_rank():
    """Started without torchrun (no RANK or WORLD_SIZE), initialize() trains as one rank and
    says so on one line of stderr, naming how to shard."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, zeroshard\n"
        "model = torch.nn.Linear(4, 4)\n"
        "engine = zeroshard.initialize(model, {'train_micro_batch_size_per_gpu': 1, "
        "'zero_optimization': {'stage': 2}})\n"
        "engine.backward(model(torch.ones(1, 4)).sum()); engine.step()\n"
        "print(engine.world_size)\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    lines = [line for line in done.stderr.splitlines() if "zeroshard" in line]
    assert len(lines) == 1 and "single rank" in lines[0] and "nothing is sharded" in lines[0], done.stderr
    assert "torchrun --nproc-per-node" in lines[0]


def _plans(rank, world_size):
    import zeroshard

    plans = {}
    for stage in (0, 1, 2, 3):
        engine = zeroshard.initialize(make_model(), _config(stage))
        plans[stage] = engine.plan()
    return plans


def test_plan_says_what_each_stage_shards_over_which_ranks_and_where(runs):
    """engine.plan(): one line per state; stage s shards the optimizer state from 1, the
    gradients from 2 and the parameters at 3, over every rank of the group, on the compute
    device."""
    plans = runs.result(2, "plans")[0]
    for stage, plan in plans.items():
        lines = plan.splitlines()
        assert [line.split(":")[0] for line in lines] == ["parameters", "gradients", "optimizer state"], plan
        for line, sharded_from in zip(lines, (3, 2, 1)):
            expected = "sharded over ranks 0-1 (2 shards)" if stage >= sharded_from else "replicated on ranks 0-1"
            assert expected in line and line.endswith(", on cpu"), f"stage {stage}: {line}"
