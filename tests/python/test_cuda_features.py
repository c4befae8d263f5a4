"""CUDA at world size 1 (NCCL): ZeRO-Offload and fp16 loss scaling on the GPU. Skipped where
torch has no CUDA device (CI on CPU); benchmarks/gpu_check.sh runs it.

Offload on a GPU moves real bytes: gradient shards to pinned host memory, the AdamW step on the
CPU, updated shards (and at stage 3 the offloaded parameter shards before each gather) back to
the device, all ordered by streams and events that a CPU run never exercises. Each offloaded
run is held to single-process torch.optim.AdamW on the GPU (the host step is the CPU's fused
kernel, not the GPU's: equal to fp32 rounding, not to the bit), and where the optimizer stays
on the device (offload_param alone) to the run without offload, bitwise. fp16 is held to the
same recipe in plain torch (16-bit compute, fp32 master weights, the loss scale); an overflow
skips the step and halves the scale.
"""

import pytest
import torch

from cuda_runs import (DEVICE, STAGE_WAYS, assert_bitwise, cuda_config, group,  # noqa: F401 (group: a fixture)
                       needs_cuda, state_of)
from model_state import offloaded_state_bytes
from models import global_batch, make_model
from test_offload import OPTIMIZER, PARAMS, VARIANTS, _padded_elements
from training import MICRO, adamw_reference, assert_like_adamw, train_global_batches

pytestmark = needs_cuda

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5  # fp32 rounding: the host's fused AdamW against torch's on the GPU
GAS, CLIP = 2, 0.05      # an fp32 gradient shard accumulated over two micro-batches, then clipped
OFFLOADS = [pytest.param(stage, way, name, id=f"{p.id}-{name}")
            for p in STAGE_WAYS for stage, way in [p.values] if stage > 0 for name in VARIANTS[stage]]


def _offload_config(stage, gather_stream, offload=None):
    return cuda_config(stage, gather_stream, gas=GAS, clip=CLIP, zero=offload)


def _train(group, config):
    import zeroshard

    model = make_model().to(DEVICE)
    engine = zeroshard.initialize(model, config, process_group=group)
    losses = train_global_batches(model, engine, 0, 1, range(STEPS))
    assert all(p.device.type == DEVICE for p in model.parameters())
    return {"losses": losses, "state": engine.full_state_dict(), **state_of(engine),
            "memory": engine.memory_stats(), "plan": engine.plan()}


@pytest.mark.parametrize("stage,gather_stream,variant", OFFLOADS)
def test_offload_on_cuda_trains_like_adamw_and_holds_the_offloaded_bytes(group, stage, gather_stream, variant):
    offload = VARIANTS[stage][variant]
    run = _train(group, _offload_config(stage, gather_stream, offload))
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * GAS, clip=CLIP, device=DEVICE)
    assert_like_adamw(run, ref_losses, {k: v.cpu() for k, v in ref_state.items()}, "fp32",
                      f"stage {stage}, {variant} offloaded", rtol=RTOL, atol=ATOL)

    plain = _train(group, _offload_config(stage, gather_stream))
    if "offload_optimizer" not in offload:
        # The same GPU kernels on the same data: only where the shards wait between uses differs.
        for kind in ("master", "params"):
            assert_bitwise(run[kind], plain[kind], f"stage {stage}, {variant} offloaded, {kind}")
        assert run["losses"] == plain["losses"]

    # The bytes by place, exactly (test_offload.py's formulas); nothing offloaded without offload.
    mem = run["memory"]
    expected = offloaded_state_bytes(stage, 1, _padded_elements(plain, stage, "fp32", 1), "fp32",
                                     optimizer="offload_optimizer" in offload, params="offload_param" in offload)
    assert {k: mem[k] for k in expected} == expected, mem
    assert plain["memory"]["host_total"] == 0
    assert run["plan"].count("in host memory") == len(offload), run["plan"]


# fp16: a dynamic scale of 2^10 that nothing overflows in these steps, so the engine's scale is
# the reference's static one throughout.
SCALE_POWER = 10


@pytest.mark.parametrize("stage,gather_stream", STAGE_WAYS)
def test_fp16_on_cuda_follows_the_fp32_master_recipe(group, stage, gather_stream):
    import zeroshard

    config = cuda_config(stage, gather_stream, precision="fp16", loss_scaling={"initial_scale_power": SCALE_POWER})
    model = make_model().to(DEVICE)
    engine = zeroshard.initialize(model, config, process_group=group)
    losses = train_global_batches(model, engine, 0, 1, range(STEPS))
    assert all(p.dtype == torch.float16 and p.device.type == DEVICE for p in model.parameters())
    assert (engine.skipped_steps, engine.loss_scale) == (0, 2 ** SCALE_POWER)
    ref_losses, ref_state = adamw_reference(STEPS, MICRO, precision="fp16", loss_scale=2 ** SCALE_POWER, device=DEVICE)
    assert_like_adamw({"losses": losses, "state": engine.full_state_dict()}, ref_losses,
                      {k: v.cpu() for k, v in ref_state.items()}, "fp16", f"fp16 stage {stage}")


@pytest.mark.parametrize("stage,gather_stream", [w for w in STAGE_WAYS if w.values[0] >= 2])
def test_fp16_overflow_on_cuda_skips_the_step_and_halves_the_scale(group, stage, gather_stream):
    """An infinite loss at step 1 of 0-3: the weights (fp32 masters and fp16 copies) stay those
    of step 0, the step is counted as skipped and the scale halves (hysteresis 1); the other
    steps train. Read after the later steps, so a skip decided on the device and counted on the
    host later (issue 29, item 8) holds too."""
    import zeroshard

    config = cuda_config(stage, gather_stream, precision="fp16",
                         loss_scaling={"initial_scale_power": SCALE_POWER, "hysteresis": 1})
    model = make_model().to(DEVICE)
    engine = zeroshard.initialize(model, config, process_group=group)
    states = []
    for step in range(4):
        loss = model.loss(global_batch(step, MICRO).to(DEVICE))
        engine.backward(loss * float("inf") if step == 1 else loss)
        engine.step()
        states.append(state_of(engine))
    for kind in ("master", "params"):
        assert_bitwise(states[1][kind], states[0][kind], f"stage {stage}: the overflowed step changed {kind}")
        for later in (2, 3):
            changed = [k for k, v in states[later][kind].items() if not torch.equal(v, states[later - 1][kind][k])]
            assert changed, f"stage {stage}: step {later} after the overflow left every {kind} unchanged"
    assert (engine.skipped_steps, engine.loss_scale) == (1, 2 ** (SCALE_POWER - 1))
