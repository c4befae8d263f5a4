"""Non-finite gradients in fp32 and bf16 (zeroshard.nonfinite), at 2 ranks in one spawned run.

At step 2 rank 1 makes the gradient of one parameter (blocks.1.up.weight) infinite with a tensor
hook, or its loss NaN: by default every rank raises at that step, naming the step and the first
parameter whose gradient is not finite, and nothing is updated; with "skip" every rank skips the
step (counted in skipped_steps, the weights those of step 1 bit for bit) and trains on, rank 0
warning once. With clipping the check reads the norm clipping computes; without, one more pass.
The deferred check (zeroshard.nonfinite_check "deferred", GPUs' default, chosen here on CPU):
the kernel skips the step on the device and the host acts a step later (or at the log line, a
save, check_last_step()), with the numbers of a run that skipped the step at once.
"""

import os
import warnings

import pytest
import torch

from models import global_batch, make_model
from spawn import SharedRuns
from training import MICRO, engine_config

WORLD = 2
BAD_STEP = 2
TARGET = "blocks.1.up.weight"


def _case(rank, world_size, stage, precision, mode, how, clip):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, engine_config(stage, precision=precision, clip=clip,
                                                       zeroshard={"nonfinite": mode}))
    error, states, warned, _ = _steps(model, engine, rank, how, (1, 2, 3))
    return {"error": error, "states": states, "warned": warned, "skipped": engine.skipped_steps}


CASES = {f"stage{stage}_{precision}_{mode}_{how}_{'clip' if clip else 'noclip'}": (stage, precision, mode, how, clip)
         for stage, precision, mode, how, clip in [
             (0, "fp32", "error", "param", None), (1, "fp32", "error", "param", 1.0),
             (2, "bf16", "error", "param", None), (3, "fp32", "error", "param", 1.0),
             (3, "bf16", "error", "loss", None),
             (1, "fp32", "skip", "param", None), (2, "bf16", "skip", "loss", 1.0), (3, "fp32", "skip", "param", None)]}


@pytest.fixture(scope="module")
def runs():
    return SharedRuns({WORLD: {name: (_case, *args) for name, args in CASES.items()}})


@pytest.mark.parametrize("case", [c for c in CASES if "_error_" in c])
def test_a_non_finite_gradient_stops_every_rank_naming_the_step_and_parameter(runs, case):
    stage, how = CASES[case][0], CASES[case][3]
    # A NaN loss reaches every gradient: the first is the first of the engine's flat buffers
    # (the model's first parameter; at stage 3 the first unit's, the root's coming last).
    first = TARGET if how == "param" else "blocks.0.norm.weight" if stage == 3 else "embed.weight"
    for result in runs.result(WORLD, case):
        error = result["error"]
        assert error is not None, "the bad step trained"
        assert f"the gradients of step {BAD_STEP} hold an inf or NaN" in error, error
        assert f"the first parameter with a non-finite gradient is '{first}'" in error, error
        assert len(result["states"]) == BAD_STEP - 1


@pytest.mark.parametrize("case", [c for c in CASES if "_skip_" in c])
def test_skip_skips_the_step_on_every_rank_and_trains_on(runs, case):
    results = runs.result(WORLD, case)
    for rank, result in enumerate(results):
        assert result["error"] is None and result["skipped"] == 1
        before, skipped, after = result["states"]
        assert all(torch.equal(skipped[k], v) for k, v in before.items()), "the skipped step changed weights"
        assert any(not torch.equal(after[k], v) for k, v in skipped.items()), "no step after the skipped one"
        assert all(torch.isfinite(v).all() for v in after.values())
        assert len(result["warned"]) == (1 if rank == 0 else 0), result["warned"]
    assert "is skipped on every rank" in results[0]["warned"][0]
    for name, value in results[0]["states"][-1].items():
        assert torch.equal(results[1]["states"][-1][name], value), name


def test_off_and_the_key_values():
    import zeroshard

    for mode in ("error", "skip", "off"):
        assert zeroshard.Config.from_dict({"zeroshard": {"nonfinite": mode}}).zeroshard.nonfinite == mode
    with pytest.raises(ValueError, match=r'zeroshard.nonfinite: must be "error", "skip" or "off"'):
        zeroshard.Config.from_dict({"zeroshard": {"nonfinite": "ignore"}})


# zeroshard.nonfinite_check "deferred" (the default where gradients are on a GPU; chosen here on
# CPU): the optimizer kernel skips the step on the device and the host learns of it later.
DEFERRED = {"nonfinite_check": "deferred"}
# An lr that moves every step, so that a schedule counting a skipped step shows in the weights.
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10,
                                           "warmup_type": "linear"}}


def _steps(model, engine, rank, how, steps):
    """Trains `steps`; at step BAD_STEP rank 1 poisons `how` ("param": an inf in a row of TARGET's
    gradient, "loss": a NaN loss). Returns (error or None, weights after each completed step, the
    non-finite warnings, the lr after each completed step)."""
    poison = {"on": False}
    param = dict(model.named_parameters())[TARGET]
    param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                        if poison["on"] and how == "param" else g)
    states, warned, lrs = [], [], []
    for step in steps:
        poison["on"] = step == BAD_STEP and rank == 1
        tokens = global_batch(step, MICRO * WORLD)[rank * MICRO:(rank + 1) * MICRO]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loss = model.loss(tokens)
                engine.backward(loss * float("nan") if poison["on"] and how == "loss" else loss)
                engine.step()
            except RuntimeError as e:
                return str(e), states, warned, lrs
        warned += [str(w.message) for w in caught if "non-finite" in str(w.message)]
        states.append(engine.full_state_dict())
        lrs.append(engine.get_lr())
    return None, states, warned, lrs


def _deferred_error(rank, world_size, stage, precision, how, clip, found):
    """"error", the bad step BAD_STEP found at `found`: "step" (the next one), "log"
    (steps_per_print = BAD_STEP), "save" (a save after it), "check" (check_last_step())."""
    import zeroshard

    model = make_model()
    config = engine_config(stage, precision=precision, clip=clip, zeroshard=DEFERRED)
    if found == "log":
        config["steps_per_print"] = BAD_STEP
    engine = zeroshard.initialize(model, config)
    steps = (1, 2, 3) if found in ("step", "log") else (1, 2)
    error, states, warned, _ = _steps(model, engine, rank, how, steps)
    if error is None and found in ("save", "check"):
        try:
            if found == "save":
                engine.save_checkpoint(f"/tmp/zeroshard-nonfinite-{os.getppid()}")  # must not be written
            else:
                engine.check_last_step()
        except RuntimeError as e:
            error = str(e)
    return {"error": error, "states": states, "warned": warned, "global_steps": engine.global_steps,
            "skipped": engine.skipped_steps}


def _deferred_skip(rank, world_size, stage, precision, how, clip):
    """"skip" with a moving lr: the deferred run beside the same run checked immediately."""
    import zeroshard

    runs = {}
    for check in ("deferred", "immediate"):
        model = make_model()
        config = engine_config(stage, precision=precision, clip=clip,
                               zeroshard={"nonfinite": "skip", "nonfinite_check": check})
        config["scheduler"] = SCHEDULE
        engine = zeroshard.initialize(model, config)
        error, states, warned, lrs = _steps(model, engine, rank, how, (1, 2, 3, 4))
        runs[check] = {"error": error, "states": states, "warned": warned, "lrs": lrs,
                       "global_steps": engine.global_steps, "skipped": engine.skipped_steps,
                       "iteration": engine.lr_scheduler.last_batch_iteration}
    return runs


def _deferred_last_step(rank, world_size, stage):
    """"skip", the run's last step bad: counted when skipped_steps is read."""
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, engine_config(stage, zeroshard={"nonfinite": "skip", **DEFERRED}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error, states, _, _ = _steps(model, engine, rank, "param", (1, 2))
        skipped = engine.skipped_steps
    return {"error": error, "skipped": skipped, "global_steps": engine.global_steps,
            "warned": [str(w.message) for w in caught if "non-finite" in str(w.message)],
            "unchanged": all(torch.equal(states[1][k], v) for k, v in states[0].items())}


def _client_scheduler(rank, world_size):
    """A torch lr_scheduler passed to initialize: "deferred" is refused, "auto" checks at once."""
    import zeroshard

    model = make_model()
    refused = None
    try:
        zeroshard.initialize(model, engine_config(1, zeroshard=DEFERRED),
                             lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    except ValueError as e:
        refused = str(e)
    engine = zeroshard.initialize(model, engine_config(1), lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 / (s + 1)))
    error, states, _, _ = _steps(model, engine, rank, "param", (1, 2, 3))
    return {"refused": refused, "error": error, "check": engine.config.zeroshard.nonfinite_check,
            "states": len(states)}


def _not_deferred(rank, world_size):
    """"deferred" where the check stays immediate (fp16's loss scaler, an offloaded optimizer):
    rank 0 warns, naming why."""
    import zeroshard

    warned = {}
    for name, extra in (("fp16", dict(precision="fp16")),
                        ("offload", dict(zero={"offload_optimizer": {"device": "cpu", "pin_memory": False}}))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeroshard.initialize(make_model(), engine_config(1, zeroshard=DEFERRED, **extra))
        warned[name] = [str(w.message) for w in caught if "nonfinite_check" in str(w.message)]
    return warned


DEFERRED_CASES = {
    **{f"error_stage{stage}_{precision}_{how}_{found}": (_deferred_error, stage, precision, how, clip, found)
       for stage, precision, how, clip, found in [
           (0, "fp32", "param", None, "step"), (1, "fp32", "param", 1.0, "step"), (2, "bf16", "loss", None, "step"),
           (3, "fp32", "param", 1.0, "step"), (3, "bf16", "param", None, "step"),
           (2, "fp32", "param", None, "log"), (1, "bf16", "param", None, "save"), (3, "fp32", "loss", 1.0, "check")]},
    **{f"skip_stage{stage}_{precision}_{how}": (_deferred_skip, stage, precision, how, clip)
       for stage, precision, how, clip in [(0, "fp32", "param", 1.0), (1, "fp32", "param", None),
                                            (2, "bf16", "loss", None), (3, "fp32", "param", 1.0),
                                            (3, "bf16", "param", None)]},
    "last_step_stage2": (_deferred_last_step, 2),
    "client_scheduler": (_client_scheduler,),
    "not_deferred": (_not_deferred,),
}


@pytest.fixture(scope="module")
def deferred_runs():
    return SharedRuns({WORLD: DEFERRED_CASES})


_FOUND = {"step": "found at step 3, whose gradients are dropped too", "log": "found at the log line of step 2",
          "save": "found at save_checkpoint()", "check": "found by check_last_step()"}


@pytest.mark.parametrize("case", [c for c in DEFERRED_CASES if c.startswith("error_")])
def test_deferred_error_names_the_bad_step_where_it_is_found_and_nothing_was_updated(deferred_runs, case):
    found = DEFERRED_CASES[case][-1]
    for result in deferred_runs.result(WORLD, case):
        error = result["error"]
        assert error is not None, "no rank raised"
        assert f"the gradients of step {BAD_STEP} hold an inf or NaN" in error, error
        assert "nothing was updated by it" in error and _FOUND[found] in error, error
        # The log line is printed inside step BAD_STEP's call: it raises there.
        completed = BAD_STEP - 1 if found == "log" else BAD_STEP
        assert len(result["states"]) == completed
        before = result["states"][BAD_STEP - 2]
        if completed == BAD_STEP:  # the bad step ran: the kernel left every weight as it was
            assert all(torch.equal(result["states"][BAD_STEP - 1][k], v) for k, v in before.items())
        assert result["global_steps"] == BAD_STEP - 1 and result["skipped"] == 0
    assert not os.path.exists(f"/tmp/zeroshard-nonfinite-{os.getpid()}")


@pytest.mark.parametrize("case", [c for c in DEFERRED_CASES if c.startswith("skip_")])
def test_deferred_skip_trains_on_as_if_the_step_was_skipped_at_once(deferred_runs, case):
    """The weights after every step, the lr once the skip is known, the step and skip counts and
    the schedule's iteration are bitwise those of the same run checked immediately: the
    kernel left weights, exp_avg, exp_avg_sq and step counts as before the bad step (any
    difference would show in the next steps' weights), and the lr schedule does not count it."""
    results = deferred_runs.result(WORLD, case)
    for rank, runs in enumerate(results):
        deferred, immediate = runs["deferred"], runs["immediate"]
        assert deferred["error"] is None and immediate["error"] is None
        assert len(deferred["states"]) == len(immediate["states"]) == 4
        for step, (got, want) in enumerate(zip(deferred["states"], immediate["states"]), start=1):
            assert all(torch.equal(got[k], v) for k, v in want.items()), f"rank {rank}: weights differ after step {step}"
        assert deferred["lrs"][BAD_STEP:] == immediate["lrs"][BAD_STEP:]
        assert deferred["lrs"][BAD_STEP - 1] != immediate["lrs"][BAD_STEP - 1], "the lr did not move"
        for key in ("global_steps", "skipped", "iteration"):
            assert deferred[key] == immediate[key], (key, deferred[key], immediate[key])
        assert deferred["skipped"] == 1 and deferred["global_steps"] == 3
        assert len(deferred["warned"]) == (1 if rank == 0 else 0), deferred["warned"]
    assert "is skipped on every rank" in results[0]["deferred"]["warned"][0]
    assert f"the gradients of step {BAD_STEP} hold" in results[0]["deferred"]["warned"][0]
    assert f"found at step {BAD_STEP + 1})" in results[0]["deferred"]["warned"][0]


def test_deferred_skip_of_the_last_step_is_counted_when_read(deferred_runs):
    for rank, result in enumerate(deferred_runs.result(WORLD, "last_step_stage2")):
        assert result["error"] is None and result["unchanged"]
        assert result["skipped"] == 1 and result["global_steps"] == 1
        assert len(result["warned"]) == (1 if rank == 0 else 0), result["warned"]


def test_a_client_scheduler_keeps_the_check_immediate(deferred_runs):
    for result in deferred_runs.result(WORLD, "client_scheduler"):
        assert "zeroshard.nonfinite_check" in result["refused"] and "lr_scheduler" in result["refused"]
        assert result["check"] == "immediate"
        assert f"the first parameter with a non-finite gradient is '{TARGET}'" in result["error"]
        assert result["states"] == BAD_STEP - 1


def test_deferred_is_not_used_with_fp16_or_an_offloaded_optimizer_and_says_so(deferred_runs):
    for rank, warned in enumerate(deferred_runs.result(WORLD, "not_deferred")):
        if rank != 0:
            assert warned == {"fp16": [], "offload": []}
            continue
        assert len(warned["fp16"]) == 1 and "loss scaler" in warned["fp16"][0], warned
        assert len(warned["offload"]) == 1 and "offloaded optimizer" in warned["offload"][0], warned
        assert 'zeroshard.nonfinite_check "deferred" is not used' in warned["fp16"][0]


def test_nonfinite_check_values():
    import zeroshard

    assert zeroshard.Config.from_dict({}).zeroshard.nonfinite_check == "auto"
    for check in ("auto", "immediate", "deferred"):
        config = zeroshard.Config.from_dict({"zeroshard": {"nonfinite_check": check}})
        assert config.zeroshard.nonfinite_check == check
    with pytest.raises(ValueError, match=r'zeroshard.nonfinite_check: must be "auto", "immediate" or "deferred"'):
        zeroshard.Config.from_dict({"zeroshard": {"nonfinite_check": "later"}})
