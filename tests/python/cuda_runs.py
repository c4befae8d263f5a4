"""What the CUDA tests (test_cuda*.py) share: the process group of one they run in, the config
they train with, and the two ways stage 3 gathers.

The group is made in the test process, as zeroshard.init_distributed makes it (Gloo for CPU
tensors, NCCL for CUDA tensors), and torn down after each module, so the other modules (which
start their own Gloo ranks) never see it. benchmarks/gpu_check.sh runs these files on a GPU.
"""

import os

import pytest
import torch

from training import engine_config

DEVICE = "cuda"
# The variables init_distributed sets for a group of one (its store on a fresh port).
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Stage 3 issues its all-gathers (and, with offload_param, their host-to-device copies) from the
# compute stream, or from a side stream with zeroshard.stage3_gather_stream (issue 29, item 7).
# Each stage-3 case runs both ways; the other stages have one.
GATHER_WAYS = {"compute_stream": False, "gather_stream": True}
STAGE_WAYS = [pytest.param(stage, False, id=f"stage{stage}") for stage in (0, 1, 2)] + \
    [pytest.param(3, on, id=f"stage3-{way}") for way, on in GATHER_WAYS.items()]
STAGE3_WAYS = [pytest.param(on, id=way) for way, on in GATHER_WAYS.items()]


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist
    import zeroshard

    assert not dist.is_initialized(), "the CUDA tests need a process without a torch.distributed group"
    saved = {name: os.environ.get(name) for name in _RENDEZVOUS}
    torch.cuda.set_device(0)
    world = zeroshard.init_distributed(timeout_seconds=60)
    try:
        assert dist.get_world_size() == 1
        assert "nccl" in str(dist.get_backend(world)), dist.get_backend(world)  # CUDA tensors go through NCCL
        yield world
    finally:
        dist.destroy_process_group()
        # The next module's group then rendezvouses on a port of its own, not on this one's.
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def with_gather_stream(config, stage, gather_stream):
    """config with stage 3's gather stream set as asked (the key only at stage 3)."""
    assert stage == 3 or not gather_stream, "only stage 3 gathers parameters"
    if stage == 3:
        config.setdefault("zeroshard", {})["stage3_gather_stream"] = gather_stream
    return config


def cuda_config(stage, gather_stream=False, gas=1, clip=0.0, precision="fp32", zero=None, **kwargs):
    """Small buckets (several reductions in flight); at stage 3 every parameter sharded, so that
    every unit, the root included, is gathered and released around each use."""
    zero = {"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0, **(zero or {})}
    config = engine_config(stage, gas=gas, clip=clip, precision=precision, timeout=60, zero=zero, **kwargs)
    return with_gather_stream(config, stage, gather_stream)


def state_of(engine):
    """The fp32 master weights and the compute-dtype parameters (with the buffers), on the CPU."""
    return {"master": engine.full_state_dict(dtype=torch.float32), "params": engine.full_state_dict()}


def assert_bitwise(actual, expected, what):
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, f"{what}: {name} is {actual[name].dtype}, not {value.dtype}"
        assert torch.equal(actual[name], value), f"{what}: {name} differs"
