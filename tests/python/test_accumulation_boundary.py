"""set_gradient_accumulation_boundary and backward(scale_wrt_gas=False), as the Hugging Face
Trainer drives them through accelerate: windows forced as 4, 2 (ended early, as at the end of an
epoch) and 4 micro-steps with gradient_accumulation_steps 4 train exactly like single-process
torch.optim.AdamW taking one step per window on the window's mean loss; the step count is 3 (the
log line, global_steps, the default checkpoint tag), and a checkpoint after the short window
resumes. A forced False at the natural boundary keeps accumulating. Both through zeroshard.Engine
and the DeepSpeed drop-in, 2 ranks (Gloo), one spawned pair for every case (spawn.SharedRuns).
The engine alone, from C++: tests/cpp/engine/test_engine_accumulation.cpp.
"""

import pytest
import torch

from accumulation_runs import (GAS, MICRO, WINDOWS, dropin_accelerate_loop, dropin_false_at_the_boundary,
                               dropin_forced_windows, dropin_scale_wrt_gas, forced_windows)
from models import global_batch, make_model
from spawn import SharedRuns
from training import AdamWReference

WORLD = 2
STAGES = (0, 1, 2, 3)
# Per micro-step, read after its backward: whether it ends its window (and the optimizer steps).
BOUNDARIES = [False, False, False, True, False, True, False, False, False, True]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {}
    for stage in STAGES:
        cases[f"engine_stage{stage}"] = (forced_windows, stage, str(tmp_path_factory.mktemp(f"engine{stage}")))
    for stage in (1, 3):
        cases[f"dropin_stage{stage}"] = (dropin_forced_windows, stage, str(tmp_path_factory.mktemp(f"ds{stage}")))
    cases["false_at_boundary"] = (dropin_false_at_the_boundary,)
    cases["accelerate_loop"] = (dropin_accelerate_loop, 3)
    cases["scale_wrt_gas"] = (dropin_scale_wrt_gas,)
    return SharedRuns({WORLD: cases})


def reference_state(windows=WINDOWS):
    """Single-process AdamW, one step per window on the window's whole global batch."""
    model = make_model()
    reference = AdamWReference(model)
    for window, length in enumerate(windows):
        reference.step(global_batch(window, MICRO * WORLD * length))
    return model.state_dict()


def assert_like(state, expected, what):
    assert set(state) == set(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=f"{what} {name}")


@pytest.mark.parametrize("stage", STAGES)
def test_windows_forced_as_4_2_4_match_adamw_on_each_windows_mean(runs, stage):
    results = runs.result(WORLD, f"engine_stage{stage}")
    expected = reference_state()
    for rank, out in enumerate(results):
        assert out["record"] == [(b, b) for b in BOUNDARIES], rank
        assert (out["global_steps"], out["micro_steps"]) == (3, 10)
        assert_like(out["state"], expected, f"stage {stage} rank {rank}")
    # Rank 0 logs one line per window (steps_per_print 1), numbered by windows, not micro-steps / 4.
    assert [line.split(",")[0] for line in results[0]["lines"]] == ["step=1", "step=2", "step=3"]
    assert results[1]["lines"] == []


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_after_the_short_window_resumes_and_tags_count_windows(runs, stage):
    for out in runs.result(WORLD, f"engine_stage{stage}"):
        assert out["saved"] == "global_step2"  # after 6 micro-steps: 2 windows, not 6 // 4
        assert out["default tag"] == "global_step3"
        # Loaded: 2 windows; micro_steps as if they had been whole (the load's rule).
        assert out["loaded"] == dict(path="global_step2", global_steps=2, micro_steps=2 * GAS)
        for name, value in out["state"].items():
            assert torch.equal(out["resumed state"][name], value), name


@pytest.mark.parametrize("stage", [1, 3])
def test_the_deepspeed_dropin_counts_the_forced_windows(runs, stage):
    expected = reference_state()
    for rank, out in enumerate(runs.result(WORLD, f"dropin_stage{stage}")):
        # The override is what is_gradient_accumulation_boundary() says, before and after backward.
        assert out["before"] == BOUNDARIES
        assert out["record"] == [(b, True) for b in BOUNDARIES]  # backward returns the loss as given
        assert out["global_steps"] == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
        assert out["micro_steps"] == 10
        assert out["samples"] == 3 * MICRO * GAS * WORLD  # DeepSpeed adds train_batch_size per boundary
        assert "global_step3" in out["checkpoints"]
        assert_like(out["state"], expected, f"drop-in stage {stage} rank {rank}")


def test_a_forced_false_at_the_natural_boundary_keeps_accumulating(runs):
    for out in runs.result(WORLD, "false_at_boundary"):
        assert out["steps"][:2] == [(False, 0)] * 2 and out["unchanged"]
        # None counts again: the window has 2 micro-steps of 2, so the next one ends it (where
        # DeepSpeed's (micro_steps + 1) % 2 would say no: its count ignores the override).
        assert out["counted"] is True
        assert out["steps"][2] == (True, 1) and out["micro_steps"] == 3


def test_backward_without_scale_wrt_gas_equals_backward_of_loss_over_gas_bitwise(runs):
    for (steps, scaled), (steps_unscaled, unscaled) in runs.result(WORLD, "scale_wrt_gas"):
        assert steps == steps_unscaled == 2
        for name, value in scaled.items():
            assert torch.equal(unscaled[name], value), name


def test_the_dropin_takes_accelerates_loop_that_steps_only_at_the_boundary(runs):
    """accelerate calls step() only after a window's last backward (DeepSpeed allows it): the
    same weights, bitwise, as step() after every backward; a second backward after one that
    ended a window, with no step() between, is an error saying to step."""
    for out in runs.result(WORLD, "accelerate_loop"):
        (steps_every, every), (steps_sync, sync) = out["states"]
        assert steps_every == steps_sync == len(WINDOWS)
        for name, value in every.items():
            assert torch.equal(sync[name], value), name
        assert out["error"] is not None and "call engine.step() after that backward" in out["error"]
