"""fp16 with DeepSpeed's loss scaling: overflow skips the step on every rank, hysteresis,
growth after loss_scale_window clean steps, min_loss_scale, static scales, and training that
follows fp32. The cases share one spawned pair of ranks (spawn.SharedRuns), each with its own
result and failure."""

import pytest
import torch

from models import global_batch, make_model
from spawn import SharedRuns
from training import MICRO, engine_config, train_global_batches


HYSTERESIS = {"initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 3}
MIN_SCALE = {"initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}
STATIC = {"loss_scale": 128}


@pytest.fixture(scope="module")
def runs():
    cases = {f"overflow_stage{stage}": (_run, stage, HYSTERESIS, {1, 2}, 7) for stage in (0, 1, 2, 3)}
    cases["min_loss_scale"] = (_run, 2, MIN_SCALE, {0, 1, 2}, 3)
    cases["static"] = (_run, 2, STATIC, {1}, 6)
    cases |= {f"losses_{precision}": (_losses, precision) for precision in ("fp16", "fp32")}
    return SharedRuns({2: cases})


def _config(stage, precision="fp16", **loss_scaling):
    return engine_config(stage, weight_decay=None, precision=precision,
                         loss_scaling=loss_scaling if precision == "fp16" else None,
                         zero={"stage3_param_persistence_threshold": 0})


def _run(rank, world_size, stage, fp16, inject_at, steps):
    """Trains `steps` steps; on the steps in inject_at, rank 1 alone gets an inf gradient.
    Returns per step: (loss scale after it, whether the optimizer stepped, whether the
    parameters changed), and the skipped-step count."""
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, _config(stage, **fp16))
    history = []
    for step in range(steps):
        before = engine.full_state_dict()
        tokens = global_batch(step, MICRO * world_size)
        loss = model.loss(tokens[rank * MICRO:(rank + 1) * MICRO])
        if step in inject_at and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        stepped = engine.step()
        after = engine.full_state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        history.append((engine.loss_scale, stepped, changed))
    return history, engine.skipped_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_on_one_rank_skips_the_step_everywhere_and_scale_follows_deepspeed(runs, stage):
    for history, skipped in runs.result(2, f"overflow_stage{stage}"):
        scales = [h[0] for h in history]
        # Overflow 1 spends the hysteresis, overflow 2 halves; the 3rd clean step after it (a
        # whole loss_scale_window) doubles, as DeepSpeed's DynamicLossScaler.
        assert scales == [256, 256, 128, 128, 128, 256, 256]
        assert [h[1] for h in history] == [True, False, False, True, True, True, True]
        assert [h[2] for h in history] == [True, False, False, True, True, True, True]
        assert skipped == 2


def test_scale_never_drops_below_min_loss_scale(runs):
    history, skipped = runs.result(2, "min_loss_scale")[0]
    assert [h[0] for h in history] == [1, 1, 1]
    assert skipped == 3


def test_static_loss_scale_skips_overflows_and_never_changes(runs):
    history, skipped = runs.result(2, "static")[0]
    assert [h[0] for h in history] == [128] * 6
    assert [h[1] for h in history] == [True, False, True, True, True, True]
    assert skipped == 1


def _losses(rank, world_size, precision):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, _config(2, precision, initial_scale_power=10))
    return train_global_batches(model, engine, rank, world_size, range(6)), engine.skipped_steps


def test_fp16_training_follows_fp32(runs):
    fp16, skipped = runs.result(2, "losses_fp16")[0]
    fp32, _ = runs.result(2, "losses_fp32")[0]
    assert skipped == 0
    assert fp16 == pytest.approx(fp32, rel=1e-2)
    assert fp16[-1] < fp16[0]
