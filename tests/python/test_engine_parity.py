"""Every stage (0 to 3) trains like single-process torch.optim.AdamW on the same global batch.

Each case trains the same model with stages 0 to 3 side by side on real processes (Gloo; the
cases of a world size share one spawned run, spawn.SharedRuns, each with its own result and
failure), and compares every stage's losses and final parameters with a reference
computed here in one process. Tolerance: fp32 rounding, rtol 1e-4 / atol 1e-5 on parameters
after STEPS steps (the reductions sum in a different order than one big batch does).
"""

import pytest
import torch

from conftest import WORLD_SIZES
from models import make_model
from spawn import SharedRuns
from training import MICRO, adamw_reference, engine_config, no_decay_groups, train_global_batches

STEPS = 4
RTOL, ATOL = 1e-4, 1e-5
STAGES = (0, 1, 2, 3)


def _config(stage, gas, clip):
    # A small bucket size makes several buckets, so reduction overlaps backward (overlap_comm
    # off: test_grad_reducer.py). Threshold 0: at stage 3 every parameter is sharded, none kept
    # gathered.
    return engine_config(stage, gas=gas, clip=clip, zero={"reduce_bucket_size": 700, "overlap_comm": True,
                                                          "stage3_param_persistence_threshold": 0})


def _train(rank, world_size, gas, clip, two_groups):
    import zeroshard

    results = {}
    for stage in STAGES:
        model = make_model()
        groups = no_decay_groups(model) if two_groups else None
        engine = zeroshard.initialize(model, _config(stage, gas, clip), param_groups=groups)
        losses = train_global_batches(model, engine, rank, world_size, range(STEPS), MICRO)
        results[stage] = (losses, engine.full_state_dict())
    return results if rank == 0 else None


CASES = {
    "plain": dict(gas=1, clip=0.0, two_groups=False),
    "accumulation": dict(gas=2, clip=0.0, two_groups=False),
    "clipping": dict(gas=1, clip=0.05, two_groups=False),
    "two_param_groups": dict(gas=1, clip=0.0, two_groups=True),
}


@pytest.fixture(scope="module")
def runs():
    return SharedRuns({ws: {name: (_train, c["gas"], c["clip"], c["two_groups"]) for name, c in CASES.items()}
                       for ws in WORLD_SIZES})


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stages_match_single_process_adamw(runs, case, world_size):
    kwargs = CASES[case]
    results = runs.result(world_size, case)[0]
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * world_size * kwargs["gas"], clip=kwargs["clip"],
                                            two_groups=kwargs["two_groups"])
    for stage, (losses, state) in results.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} losses"
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"stage {stage}, {name}: {m}")
    # Switching stage at a fixed world size does not change the numbers (to rounding).
    for name in ref_state:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[2][1][name], results[1][1][name], rtol=1e-5, atol=1e-6)
