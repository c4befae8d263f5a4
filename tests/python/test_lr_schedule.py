"""The config's "scheduler": DeepSpeed's five schedules as the engine runs them.

The lr (and OneCycle's betas) every optimizer step uses are those of DeepSpeed's own scheduler
classes (deepspeed.runtime.lr_schedules on a torch AdamW, driven the same way), bitwise;
training under a schedule matches single-process torch AdamW stepped with those values; an fp16
step skipped for an overflow does not advance the schedule; a checkpoint carries the schedule
on; rank 0 prints the steps_per_print line. The cases share their spawned process groups: one
group of one rank, one of two (spawn.SharedRuns: its two groups of cases, the second saving
the checkpoint, each with its own result and failure), and one rank resuming the checkpoint.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch

from checkpoint_runs import GLOBAL
from checkpoint_runs import config as checkpoint_config
from models import global_batch, make_model, make_stateful_model
from spawn import SharedRuns, run_ranks
from training import LR, MICRO, AdamWReference, engine_config, no_decay_groups, train_global_batches

NO_DECAY_LR = 2e-3  # no_decay_groups' second group
STEPS = 12          # optimizer steps per schedule: past every phase of the cases below
GAS = 2

CASES = {
    "WarmupLR": ("WarmupLR", {"warmup_min_lr": 1e-3, "warmup_max_lr": 0.02, "warmup_num_steps": 5}),
    # No warmup_max_lr: each group warms up to its own lr.
    "WarmupLR_linear_to_group_lrs": ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    # Constructed at iteration 2: the groups keep their lr until the schedule's first step.
    "WarmupLR_from_iteration_2": ("WarmupLR", {"warmup_num_steps": 6, "last_batch_iteration": 2}),
    "WarmupDecayLR": ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4}),
    "WarmupCosineLR": ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                                          "cos_min_ratio": 0.01, "warmup_type": "linear"}),
    "WarmupCosineLR_log": ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 4}),
    "OneCycle": ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
                              "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
                              "decay_mom_rate": 0.1}),
    "OneCycle_stairs_no_momentum": ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                 "cycle_first_step_size": 4, "cycle_first_stair_count": 2,
                                                 "cycle_momentum": False}),
    "LRRangeTest": ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3,
                                    "lr_range_test_step_rate": 0.5}),
    "LRRangeTest_staircase": ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3,
                                              "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}),
}
API_CASE = ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear"})
FP16_CASE = ("WarmupLR", {"warmup_num_steps": 8, "warmup_type": "linear"})
FP16_OVERFLOWS = (1, 4)  # steps whose loss is made inf
FP16_STEPS = 7
TRAINED = ("WarmupCosineLR", "OneCycle")  # against torch AdamW, at 2 ranks and stages 1-3
TRAIN_STEPS = 6


def _config(scheduler_type, params, stage=1, gas=GAS, **keys):
    config = engine_config(stage, gas=gas, zero={"stage3_param_persistence_threshold": 0}, **keys)
    config["scheduler"] = {"type": scheduler_type, "params": params}
    return config


def _deepspeed(scheduler_type, params, base_lrs, steps):
    """DeepSpeed's own scheduler class on a torch AdamW with one group per base lr: the (lrs,
    betas) each of `steps` optimizer steps uses (what the groups hold before it; the scheduler
    steps after it), and the scheduler."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    weights = [torch.zeros(1, requires_grad=True) for _ in base_lrs]
    optimizer = torch.optim.AdamW([{"params": [w], "lr": lr} for w, lr in zip(weights, base_lrs)])
    scheduler = getattr(lr_schedules, scheduler_type)(optimizer, **params)
    used = []
    for _ in range(steps):
        used.append(_values(optimizer))
        scheduler.step()
    return used, scheduler, optimizer


def _values(optimizer):
    return [g["lr"] for g in optimizer.param_groups], [tuple(g["betas"]) for g in optimizer.param_groups]


def _engine_values(engine):
    return engine.get_lrs(), [tuple(b) for b in engine.get_betas()]


def _train_recording(model, engine, rank, world_size, steps, micro=MICRO, after_step=None):
    """Trains; returns the (lrs, betas) the engine holds before each optimizer step."""
    used = []
    train_global_batches(model, engine, rank, world_size, steps, micro,
                         before_step=lambda step, tokens: used.append(_engine_values(engine)), after_step=after_step)
    return used


# --- one rank: every schedule's sequence, the scheduler object, fp16 skips --------------------

def _sequences(rank, world_size):
    import zeroshard

    out = {}
    for name, (scheduler_type, params) in CASES.items():
        model = make_model()
        engine = zeroshard.initialize(model, _config(scheduler_type, params), param_groups=no_decay_groups(model))
        used = _train_recording(model, engine, rank, world_size, range(STEPS))
        out[name] = used, engine.lr_schedule_last_batch_iteration
    return out


def _scheduler_object(rank, world_size):
    import zeroshard
    from zeroshard.lr_schedule import ConfigSchedule

    model = make_model()
    engine = zeroshard.initialize(model, _config(*API_CASE), param_groups=no_decay_groups(model))
    schedule = ConfigSchedule(engine._core)
    seen = {"start": (schedule.last_batch_iteration, schedule.get_lr(), schedule.get_last_lr())}
    train_global_batches(model, engine, rank, world_size, range(3))
    seen["after_3"] = (schedule.last_batch_iteration, schedule.get_lr(), schedule.get_last_lr(), schedule.state_dict())
    errors = []
    for call in (schedule.step, lambda: engine.set_lr(0.5)):
        try:
            call()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    seen["errors"] = errors
    schedule.load_state_dict({"last_batch_iteration": 7})
    seen["loaded"] = (schedule.last_batch_iteration, schedule.get_lr(), engine.get_lrs())
    train_global_batches(model, engine, rank, world_size, range(3, 4))
    seen["after_load"] = (schedule.last_batch_iteration, engine.get_lrs())
    return seen


def _fp16_skips(rank, world_size):
    import zeroshard

    model = make_model()
    config = _config(*FP16_CASE, gas=1, weight_decay=None, precision="fp16",
                     loss_scaling={"initial_scale_power": 8, "hysteresis": 1})
    config["steps_per_print"] = 1
    engine = zeroshard.initialize(model, config)
    lines = []
    engine._core.set_log_sink(lines.append)
    used, stepped = [], []
    for step in range(FP16_STEPS):
        used.append(engine.get_lrs())
        loss = model.loss(global_batch(step, MICRO))
        if step in FP16_OVERFLOWS:
            loss = loss * float("inf")
        engine.backward(loss)
        stepped.append(engine.step())
    return used, stepped, engine.lr_schedule_last_batch_iteration, engine.skipped_steps, lines


def _one_rank(rank, world_size):
    return _sequences(rank, world_size), _scheduler_object(rank, world_size), _fp16_skips(rank, world_size)


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(_one_rank, 1)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_uses_deepspeeds_lr_and_betas_at_every_step(one_rank, case):
    used, last_batch_iteration = one_rank[0][case]
    scheduler_type, params = CASES[case]
    expected, scheduler, _ = _deepspeed(scheduler_type, params, [LR, NO_DECAY_LR], STEPS)
    # Bitwise: the same doubles, step by step, for both param groups.
    for step, (got, want) in enumerate(zip(used, expected, strict=True)):
        assert got == want, f"{case}, optimizer step {step}: engine {got}, DeepSpeed {want}"
    assert last_batch_iteration == scheduler.last_batch_iteration


def test_the_scheduler_object_reads_like_deepspeeds_and_refuses_a_second_stepper(one_rank):
    seen = one_rank[1]
    _, scheduler, optimizer = _deepspeed(*API_CASE, [LR, NO_DECAY_LR], 0)
    assert seen["start"] == (scheduler.last_batch_iteration, scheduler.get_lr(), scheduler.get_last_lr())
    for _ in range(3):
        scheduler.step()
    assert seen["after_3"] == (2, scheduler.get_lr(), scheduler.get_last_lr(), scheduler.state_dict())
    step_error, set_lr_error = seen["errors"]
    assert step_error is not None and "stepped by engine.step()" in step_error and "twice" in step_error
    assert set_lr_error is not None and "scheduler (WarmupDecayLR)" in set_lr_error
    # load_state_dict as DeepSpeed's: the iteration now, the groups' lr at the next step.
    held = [g["lr"] for g in optimizer.param_groups]
    scheduler.load_state_dict({"last_batch_iteration": 7})
    assert seen["loaded"] == (7, scheduler.get_lr(), held)
    scheduler.step()
    assert seen["after_load"] == (8, [g["lr"] for g in optimizer.param_groups])


def test_an_fp16_step_skipped_for_an_overflow_does_not_advance_the_schedule(one_rank):
    used, stepped, last_batch_iteration, skipped, lines = one_rank[2]
    assert stepped == [step not in FP16_OVERFLOWS for step in range(FP16_STEPS)]
    taken = FP16_STEPS - len(FP16_OVERFLOWS)
    expected = [lrs for lrs, _ in _deepspeed(*FP16_CASE, [LR], taken)[0]]
    # A skipped step uses the lr the next taken step uses: nothing moved in between.
    assert used == [expected[0], expected[1], expected[1], expected[2], expected[3], expected[3], expected[4]]
    assert last_batch_iteration == taken - 1 and skipped == len(FP16_OVERFLOWS)
    # steps_per_print 1 prints every boundary, skipped ones included (DeepSpeed's global_steps).
    printed = [re.match(r"step=(\d+), skipped=(\d+), lr=\[([^\]]*)\]", line).groups() for line in lines]
    assert [(int(s), int(k)) for s, k, _ in printed] == [(1, 0), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (7, 2)]
    assert [[float(v) for v in lr.split(", ")] for _, _, lr in printed[:-1]] == used[1:]


# --- two ranks: training against torch AdamW, the log line ----------------------------------

def _trained_weights(rank, world_size):
    import zeroshard

    out = {}
    for name in TRAINED:
        for stage in (1, 2, 3):
            model = make_model()
            engine = zeroshard.initialize(model, _config(*CASES[name], stage=stage),
                                          param_groups=no_decay_groups(model))
            losses = train_global_batches(model, engine, rank, world_size, range(TRAIN_STEPS))
            out[name, stage] = losses, engine.full_state_dict()
    return out


def _log_lines(rank, world_size):
    import logging

    import torch.nn.functional as F

    import zeroshard

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("zeroshard")
    handler = Collect()
    logger.addHandler(handler)
    try:
        model = make_model()
        config = _config(*FP16_CASE, stage=2)
        config["steps_per_print"] = 2
        config["wall_clock_breakdown"] = True
        engine = zeroshard.initialize(model, config)
        lrs_after, last_losses = [], []
        for step in range(5):
            tokens = global_batch(step, MICRO * world_size * GAS)
            for m in range(GAS):
                batch = tokens[(m * world_size + rank) * MICRO:][:MICRO]
                logits = engine(batch[:, :-1])  # through the engine: the forward is timed
                loss = F.cross_entropy(logits.reshape(-1, model.vocab), batch[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()
            lrs_after.append(engine.get_lrs())
            last_losses.append(loss.item())
    finally:
        logger.removeHandler(handler)
    return [r for r in records if r.startswith("step=")], lrs_after, last_losses


def _two_ranks(rank, world_size):
    weights = _trained_weights(rank, world_size)
    return (weights if rank == 0 else None), _log_lines(rank, world_size)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The checkpoint with a schedule, and the one without."""
    tmp = tmp_path_factory.mktemp("schedule_checkpoints")
    return str(tmp / "scheduled"), str(tmp / "plain")


@pytest.fixture(scope="module")
def two_rank_runs(ckpts):
    return SharedRuns({2: {"trained": (_two_ranks,), "checkpoint": (_save_and_resume, 2, *ckpts)}})


@pytest.fixture(scope="module")
def two_ranks(two_rank_runs):
    return two_rank_runs.result(2, "trained")


@pytest.mark.parametrize("name", TRAINED)
def test_training_under_a_schedule_matches_torch_adamw_stepped_with_deepspeeds_values(two_ranks, name):
    results = two_ranks[0][0]
    used, _, _ = _deepspeed(*CASES[name], [LR, NO_DECAY_LR], TRAIN_STEPS)
    model = make_model()
    reference = AdamWReference(model, groups=no_decay_groups(model))
    ref_losses = []
    for step, (lrs, betas) in enumerate(used):
        reference.set_lr(lrs)
        for group, value in zip(reference.optimizer.param_groups, betas):
            group["betas"] = value
        ref_losses.append(reference.step(global_batch(step, MICRO * 2 * GAS)))
    for stage in (1, 2, 3):
        losses, state = results[name, stage]
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage}"
        for key, ref in model.state_dict().items():
            torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"stage {stage}, {key}: {m}")


LINE = re.compile(r"step=(\d+), skipped=(\d+), lr=\[([^\]]*)\], loss_scale=(\S+), loss=(\S+), samples/s=(\S+), "
                  r"forward_ms=(\S+), backward_ms=(\S+), step_ms=(\S+), comm_ms=(\S+)$")


def test_rank_0_prints_every_steps_per_print_boundaries_with_the_wall_clock_breakdown(two_ranks):
    (lines, lrs_after, last_losses), (other_lines, _, _) = two_ranks[0][1], two_ranks[1][1]
    assert other_lines == []
    assert len(lines) == 2, lines
    for line, step in zip(lines, (2, 4)):
        match = LINE.match(line)
        assert match, line
        number, skipped, lr, scale, loss, rate, *millis = match.groups()
        assert (int(number), int(skipped), float(scale)) == (step, 0, 1.0)
        # The lr the next step uses, exactly (printed to round-trip), as DeepSpeed's line has it.
        assert [float(v) for v in lr.split(", ")] == lrs_after[step - 1]
        assert float(loss) == pytest.approx(last_losses[step - 1], rel=1e-5)
        assert float(rate) > 0
        assert all(float(ms) > 0 for ms in millis), line  # forward, backward, step, comm


# --- checkpoints ------------------------------------------------------------------------------

CKPT_CASE = ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 2,
                          "cycle_second_step_size": 3})
SAVED, RESUMED = 3, 3


def _ckpt_config(world_size, stage, scheduled=True):
    config = checkpoint_config(world_size, stage)
    if scheduled:
        config["scheduler"] = {"type": CKPT_CASE[0], "params": CKPT_CASE[1]}
    return config


def _ckpt_train(model, engine, rank, world_size, steps):
    return _train_recording(model, engine, rank, world_size, steps, GLOBAL // world_size, after_step=model.advance)


def _resume(rank, world_size, stage, ckpt, plain_ckpt):
    """Fresh engines (another initial model): one loads the checkpoint and trains on; one loads
    it without the schedule's state; one loads a checkpoint saved without a schedule."""
    import zeroshard

    model = make_stateful_model(1234)
    engine = zeroshard.initialize(model, _ckpt_config(world_size, stage))
    engine.load_checkpoint(ckpt)
    out = {"loaded_iteration": engine.lr_schedule_last_batch_iteration}
    out["used"] = _ckpt_train(model, engine, rank, world_size, range(SAVED, SAVED + RESUMED))
    out["final"] = engine.full_state_dict()
    for key, path, kwargs in (("without_state", ckpt, {"load_lr_scheduler_states": False}),
                              ("from_plain", plain_ckpt, {})):
        other = zeroshard.initialize(make_stateful_model(1234), _ckpt_config(world_size, stage))
        other.load_checkpoint(path, **kwargs)
        out[key] = other.lr_schedule_last_batch_iteration, _engine_values(other)
    return out if rank == 0 else None


def _save_and_resume(rank, world_size, stage, ckpt, plain_ckpt):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _ckpt_config(world_size, stage))
    _ckpt_train(model, engine, rank, world_size, range(SAVED))
    path = engine.save_checkpoint(ckpt)
    uninterrupted = _ckpt_train(model, engine, rank, world_size, range(SAVED, SAVED + RESUMED))
    final = engine.full_state_dict()
    plain_model = make_stateful_model(0)
    plain = zeroshard.initialize(plain_model, _ckpt_config(world_size, stage, scheduled=False))
    _ckpt_train(plain_model, plain, rank, world_size, range(1))
    plain.save_checkpoint(plain_ckpt)
    resumed = _resume(rank, world_size, stage, ckpt, plain_ckpt)
    return (path, uninterrupted, final, resumed) if rank == 0 else None


def test_a_checkpoint_carries_the_schedule_on_at_the_same_and_another_world_size(two_rank_runs, ckpts):
    ckpt, plain = ckpts
    path, uninterrupted, final, resumed = two_rank_runs.result(2, "checkpoint")[0]
    manifest = json.loads((Path(path) / "manifest.json").read_text())["manifest"]
    assert manifest["lr_scheduler"] == {"type": "OneCycle", "last_batch_iteration": SAVED - 1}
    expected, _, _ = _deepspeed(*CKPT_CASE, [LR], SAVED + RESUMED)
    assert uninterrupted == expected[SAVED:]
    start = ([CKPT_CASE[1]["cycle_min_lr"]], [(0.8, 0.99)])  # OneCycle's start values
    elsewhere = run_ranks(_resume, 1, 1, ckpt, plain)[0]
    for run, exact in ((resumed, True), (elsewhere, False)):
        assert run["loaded_iteration"] == SAVED - 1
        assert run["used"] == uninterrupted  # bitwise, at any world size
        for key, value in final.items():
            if exact:  # the same world size and stage: the same numbers
                assert torch.equal(run["final"][key], value), key
            else:
                torch.testing.assert_close(run["final"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
        # Without the saved state (not asked for, or not there) the schedule keeps its own, and
        # owns the lr: its start values replace the checkpoint's.
        assert run["without_state"] == (-1, start)
        assert run["from_plain"] == (-1, start)
