"""CUDA at world size 1 (NCCL): every stage trains like single-process torch.optim.AdamW on the
GPU, bf16 stage 3 trains, a step makes no host synchronisation, and stage 3 gives bitwise the
same numbers whether its gathers run on the compute stream or on a side stream. Skipped where
torch has no CUDA device (CI on CPU). Offload and fp16: test_cuda_features.py; checkpoints,
save_16bit_model and meta initialisation: test_cuda_state.py.

The process group of one: cuda_runs.group. benchmarks/gpu_check.sh runs this file.
"""

import pytest
import torch

from cuda_runs import (DEVICE, STAGE3_WAYS, STAGE_WAYS, assert_bitwise, cuda_config, group,  # noqa: F401 (group: a fixture)
                       needs_cuda, state_of)
from models import global_batch, make_model
from test_offload import OPTIMIZER, PARAMS
from training import MICRO, adamw_reference, train_global_batches

pytestmark = needs_cuda

STEPS = 4
RTOL, ATOL = 1e-4, 1e-5  # fp32 rounding: fused vs foreach AdamW kernels, as in test_engine_parity.py


def _config(stage, gas=1, clip=0.0, bf16=False, gather_stream=False):
    return cuda_config(stage, gather_stream, gas=gas, clip=clip, precision="bf16" if bf16 else "fp32")


CASES = {"plain": dict(gas=1, clip=0.0), "accumulation_and_clipping": dict(gas=2, clip=0.05)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stage,gather_stream", STAGE_WAYS)
def test_stage_on_cuda_matches_single_process_adamw(group, stage, gather_stream, case):
    import zeroshard

    gas, clip = CASES[case]["gas"], CASES[case]["clip"]
    model = make_model().to(DEVICE)
    engine = zeroshard.initialize(model, _config(stage, gas, clip, gather_stream=gather_stream), process_group=group)
    if stage == 3:
        # The root unit (embedding, final norm, head) holds parameters, as in every real model:
        # gathered and released around the forward and the backward like the blocks.
        root = engine.stage3_units()[-1]
        assert root["numel"] > 0 and root["persistent_numel"] == 0, root
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step, MICRO * gas).to(DEVICE)
        total = 0.0
        for micro in range(gas):
            loss = model.loss(tokens[micro * MICRO:(micro + 1) * MICRO])
            assert loss.device.type == DEVICE
            engine.backward(loss)
            assert engine.step() == (micro == gas - 1)
            total += loss.item()
        losses.append(total / gas)
    state = engine.full_state_dict()
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * gas, clip=clip, device=DEVICE)
    assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} losses"
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref.cpu(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"stage {stage}, {name}: {m}")
    # The last step's reductions ran on the CUDA buffers (through NCCL: the group's CUDA backend).
    assert engine.comm_stats()["traffic_bytes"] > 0


@pytest.mark.parametrize("gather_stream", STAGE3_WAYS)
def test_bf16_stage3_on_cuda_trains(group, gather_stream):
    import zeroshard

    model = make_model(layers=3).to(DEVICE)
    engine = zeroshard.initialize(model, _config(3, bf16=True, gather_stream=gather_stream), process_group=group)
    tokens = global_batch(0, MICRO).to(DEVICE)  # one fixed batch: the loss must fall as it is learnt
    losses = []
    for _ in range(30):
        loss = model.loss(tokens)
        assert loss.dtype == torch.bfloat16 and loss.device.type == DEVICE
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.7 * losses[0], f"bf16 stage 3 on CUDA did not learn one batch: {losses}"
    # Between steps a stage-3 parameter holds no memory; its fp32 master and state stay on the GPU.
    assert all(p.device.type == DEVICE for p in model.parameters())
    stats = engine.memory_stats()
    assert stats["optimizer"] > 0 and stats["params"] > 0
    with engine.gathered_parameters():
        assert all(p.dtype == torch.bfloat16 and p.device.type == DEVICE and p.numel() > 0 for p in model.parameters())


class _Mlp(torch.nn.Module):
    """Linear layers and tanh only, with a mean-square loss: ops that never synchronise with the
    host themselves (an embedding's backward or a cross-entropy could, depending on the torch
    version), so any synchronisation the check finds is the engine's. Each layer a stage-3 unit;
    with head=True one more Linear outside the list: a root unit that holds parameters."""

    def __init__(self, dim=64, layers=4, head=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, dim) if head else None

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.head is not None:
            x = self.head(x)
        return x.float().square().mean()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage,gather_stream", STAGE_WAYS)
def test_step_makes_no_host_synchronisation(group, stage, gather_stream, bf16):
    """After the first step (NCCL communicator set-up, stage 3's order check), forward, backward
    and step with gradient clipping only queue GPU work: collectives are waited on by the
    compute stream, staging buffers are retired without blocking, and the clipping factor is
    applied without reading the norm on the host. torch's sync debug mode turns any synchronising
    call (a .item(), a blocking copy to or from the host, a stream synchronize) into an error.
    The default config: its non-finite check decides on the device (issue 29, item 8); before
    that change it read the norm on the host once a step and this test needed it "off". At
    stage 3 the root unit holds parameters (the head), as in a real model."""
    import zeroshard

    model = _Mlp(head=True).to(DEVICE)
    config = _config(stage, gas=2, clip=0.05, bf16=bf16, gather_stream=gather_stream)
    config["zero_optimization"]["reduce_bucket_size"] = 64 * 64 + 64  # a bucket per layer
    engine = zeroshard.initialize(model, config, process_group=group)
    dtype = torch.bfloat16 if bf16 else torch.float32
    batches = [torch.randn(2, MICRO, 64, device=DEVICE, dtype=dtype) for _ in range(3)]  # made before the check

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
@pytest.mark.parametrize("stage,gather_stream", [w for w in STAGE_WAYS if w.values[0] >= 2])
def test_staging_on_cuda_is_bounded_by_the_reductions_in_flight(group, stage, gather_stream, cap):
    """With overlap_comm on, the stream-ordered waits keep the bound of the CPU path: at most
    max_inflight_reductions staging buffers in flight plus the one being filled
    (test_grad_reducer.py holds the same on Gloo). Four equal one-layer buckets (units)."""
    import zeroshard

    model = _Mlp().to(DEVICE)
    config = _config(stage, gather_stream=gather_stream)
    config["zero_optimization"].update(reduce_bucket_size=64 * 64 + 64, overlap_comm=True)
    config["zeroshard"]["max_inflight_reductions"] = cap
    engine = zeroshard.initialize(model, config, process_group=group)
    for _ in range(2):
        engine.backward(model(torch.randn(MICRO, 64, device=DEVICE)))
        engine.step()
    layer_bytes = 4 * (64 * 64 + 64)  # a multiple of 16 elements: no padding at one rank
    peak = engine.memory_stats()["staging_peak"]
    assert 2 * layer_bytes <= peak <= (cap + 1) * layer_bytes, (peak, layer_bytes)


# Where the two ways run the same kernels on the same data: the all-gathers, the copies of
# offloaded shards to the device, the reductions and AdamW. Only the stream that issues the
# gathers differs, so the numbers must be the same to the bit; a gather read before it finished,
# or a buffer reused while a gather still wrote it, changes them.
GATHER_CASES = {
    "fp32_accumulation_and_clipping": dict(gas=2, clip=0.05),
    "bf16": dict(precision="bf16", clip=0.05),
    "offload_param_and_optimizer": dict(gas=2, zero=OPTIMIZER | PARAMS),
}


@pytest.mark.parametrize("case", sorted(GATHER_CASES))
def test_stage3_gather_stream_gives_bitwise_the_compute_stream_run(group, case):
    import zeroshard

    runs = {}
    for gather_stream in (False, True):
        model = make_model().to(DEVICE)
        engine = zeroshard.initialize(model, cuda_config(3, gather_stream, **GATHER_CASES[case]), process_group=group)
        losses = train_global_batches(model, engine, 0, 1, range(STEPS))
        runs[gather_stream] = (losses, state_of(engine))
    (losses, state), (side_losses, side_state) = runs[False], runs[True]
    assert side_losses == losses, (side_losses, losses)
    for kind in state:
        assert_bitwise(side_state[kind], state[kind], f"{case}, {kind} with stage3_gather_stream")
