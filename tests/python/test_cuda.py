"""CUDA at world size 1 (NCCL): every stage trains like single-process torch.optim.AdamW on the
GPU, and bf16 stage 3 trains. Skipped where torch has no CUDA device (CI on CPU).

The process group of one is made in this process, as zeroshard.init_distributed makes it (Gloo
for CPU tensors, NCCL for CUDA tensors), and torn down after the module, so the other modules
(which start their own Gloo ranks) never see it. benchmarks/gpu_check.sh runs this file.
"""

import pytest
import torch

from models import global_batch, make_model
from training import MICRO, adamw_reference, engine_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 4
RTOL, ATOL = 1e-4, 1e-5  # fp32 rounding: fused vs foreach AdamW kernels, as in test_engine_parity.py


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist
    import zeroshard

    assert not dist.is_initialized(), "test_cuda.py needs a process without a torch.distributed group"
    torch.cuda.set_device(0)
    world = zeroshard.init_distributed(timeout_seconds=60)
    assert dist.get_world_size() == 1
    assert "nccl" in str(dist.get_backend(world)), dist.get_backend(world)  # CUDA tensors go through NCCL
    try:
        yield world
    finally:
        dist.destroy_process_group()


def _config(stage, gas=1, clip=0.0, bf16=False):
    # Small buckets (several reductions in flight); at stage 3 every parameter sharded.
    return engine_config(stage, gas=gas, clip=clip, precision="bf16" if bf16 else "fp32", timeout=60,
                         zero={"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0})


CASES = {"plain": dict(gas=1, clip=0.0), "accumulation_and_clipping": dict(gas=2, clip=0.05)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_on_cuda_matches_single_process_adamw(group, stage, case):
    import zeroshard

    gas, clip = CASES[case]["gas"], CASES[case]["clip"]
    model = make_model().cuda()
    engine = zeroshard.initialize(model, _config(stage, gas, clip), process_group=group)
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step, MICRO * gas).cuda()
        total = 0.0
        for micro in range(gas):
            loss = model.loss(tokens[micro * MICRO:(micro + 1) * MICRO])
            assert loss.is_cuda
            engine.backward(loss)
            assert engine.step() == (micro == gas - 1)
            total += loss.item()
        losses.append(total / gas)
    state = engine.full_state_dict()
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * gas, clip=clip, device="cuda")
    assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} losses"
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref.cpu(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"stage {stage}, {name}: {m}")
    # The last step's reductions ran on the CUDA buffers (through NCCL: the group's CUDA backend).
    assert engine.comm_stats()["traffic_bytes"] > 0


def test_bf16_stage3_on_cuda_trains(group):
    import zeroshard

    model = make_model(layers=3).cuda()
    engine = zeroshard.initialize(model, _config(3, bf16=True), process_group=group)
    tokens = global_batch(0, MICRO).cuda()  # one fixed batch: the loss must fall as it is learnt
    losses = []
    for _ in range(30):
        loss = model.loss(tokens)
        assert loss.dtype == torch.bfloat16 and loss.is_cuda
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.7 * losses[0], f"bf16 stage 3 on CUDA did not learn one batch: {losses}"
    # Between steps a stage-3 parameter holds no memory; its fp32 master and state stay on the GPU.
    assert all(p.is_cuda for p in model.parameters())
    stats = engine.memory_stats()
    assert stats["optimizer"] > 0 and stats["params"] > 0
    with engine.gathered_parameters():
        assert all(p.dtype == torch.bfloat16 and p.is_cuda and p.numel() > 0 for p in model.parameters())


class _Mlp(torch.nn.Module):
    """Linear layers and tanh only, with a mean-square loss: ops that never synchronise with the
    host themselves (an embedding's backward or a cross-entropy could, depending on the torch
    version), so any synchronisation the check finds is the engine's. Each layer a stage-3 unit."""

    def __init__(self, dim=64, layers=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().square().mean()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_makes_no_host_synchronisation(group, stage, bf16):
    """After the first step (NCCL communicator set-up, stage 3's order check), forward, backward
    and step with gradient clipping only queue GPU work: collectives are waited on by the
    compute stream, staging buffers are retired without blocking, and the clipping factor is
    applied without reading the norm on the host. torch's sync debug mode turns any synchronising
    call (a .item(), a blocking copy to or from the host, a stream synchronize) into an error.
    zeroshard.nonfinite "off": its check reads the norm on the host once a step (docs/config.md)."""
    import zeroshard

    model = _Mlp().cuda()
    config = _config(stage, gas=2, clip=0.05, bf16=bf16)
    config.setdefault("zeroshard", {})["nonfinite"] = "off"
    config["zero_optimization"]["reduce_bucket_size"] = 64 * 64 + 64  # a bucket per layer
    engine = zeroshard.initialize(model, config, process_group=group)
    dtype = torch.bfloat16 if bf16 else torch.float32
    batches = [torch.randn(2, MICRO, 64, device="cuda", dtype=dtype) for _ in range(3)]  # made before the check

    def train_step(xs):
        for x in xs:
            engine.backward(model(x))
            engine.step()

    train_step(batches[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for xs in batches[1:]:
            train_step(xs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.global_steps == 3


@pytest.mark.parametrize("cap", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_staging_on_cuda_is_bounded_by_the_reductions_in_flight(group, stage, cap):
    """With overlap_comm on, the stream-ordered waits keep the bound of the CPU path: at most
    max_inflight_reductions staging buffers in flight plus the one being filled
    (test_grad_reducer.py holds the same on Gloo). Four equal one-layer buckets (units)."""
    import zeroshard

    model = _Mlp().cuda()
    config = _config(stage)
    config["zero_optimization"].update(reduce_bucket_size=64 * 64 + 64, overlap_comm=True)
    config["zeroshard"]["max_inflight_reductions"] = cap
    engine = zeroshard.initialize(model, config, process_group=group)
    for _ in range(2):
        engine.backward(model(torch.randn(MICRO, 64, device="cuda")))
        engine.step()
    layer_bytes = 4 * (64 * 64 + 64)  # a multiple of 16 elements: no padding at one rank
    peak = engine.memory_stats()["staging_peak"]
    assert 2 * layer_bytes <= peak <= (cap + 1) * layer_bytes, (peak, layer_bytes)
