"""Non-finite gradients in fp32 and bf16 (zeroshard.nonfinite), at 2 ranks in one spawned run.

At step 2 rank 1 makes the gradient of one parameter (blocks.1.up.weight) infinite with a tensor
hook, or its loss NaN: by default every rank raises at that step, naming the step and the first
parameter whose gradient is not finite, and nothing is updated; with "skip" every rank skips the
step (counted in skipped_steps, the weights those of step 1 bit for bit) and trains on, rank 0
warning once. With clipping the check reads the norm clipping computes; without, one more pass.
"""

import warnings

import pytest
import torch

from models import global_batch, make_model
from spawn import SharedRuns
from training import MICRO, engine_config

WORLD = 2
BAD_STEP = 2
TARGET = "blocks.1.up.weight"


def _train(model, engine, rank, how):
    """Steps 1-3; at step BAD_STEP rank 1 poisons `how` ("param": an inf in a row of TARGET's
    gradient, "loss": a NaN loss). Returns (error or None, weights after each completed step,
    the non-finite warnings, skipped_steps)."""
    poison = {"on": False}
    param = dict(model.named_parameters())[TARGET]
    param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf"))
                        if poison["on"] and how == "param" else g)
    states, warned = [], []
    for step in (1, 2, 3):
        poison["on"] = step == BAD_STEP and rank == 1
        tokens = global_batch(step, MICRO * WORLD)[rank * MICRO:(rank + 1) * MICRO]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loss = model.loss(tokens)
                engine.backward(loss * float("nan") if poison["on"] and how == "loss" else loss)
                engine.step()
            except RuntimeError as e:
                return str(e), states, warned, engine.skipped_steps
        warned += [str(w.message) for w in caught if "non-finite" in str(w.message)]
        states.append(engine.full_state_dict())
    return None, states, warned, engine.skipped_steps


def _case(rank, world_size, stage, precision, mode, how, clip):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, engine_config(stage, precision=precision, clip=clip,
                                                       zeroshard={"nonfinite": mode}))
    error, states, warned, skipped = _train(model, engine, rank, how)
    return {"error": error, "states": states, "warned": warned, "skipped": skipped}


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
