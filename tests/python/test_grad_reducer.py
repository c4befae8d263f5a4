"""Gradient reduction and zero_optimization.overlap_comm (csrc/zeroshard/grad_reducer.*).

With overlap_comm on, a bucket's reduction runs while backward goes on and its staging buffer
lives until the reduction is retired, with at most zeroshard.max_inflight_reductions in flight; off (DeepSpeed's default below stage 3), each reduction is
waited for as soon as it starts, so at stages 2 and 3 one bucket's staging buffer is the most
that exists at once. Either way the numbers are those of single-process AdamW, and the same.
The cases share one spawned run per world size (spawn.SharedRuns), each with its own result and
failure.
"""

import pytest
import torch

from conftest import WORLD_SIZES
from models import make_model
from spawn import SharedRuns
from training import MICRO, AdamWReference, adamw_reference, engine_config, train_global_batches

STEPS = 4
GAS = 2
CLIP = 0.05
RTOL, ATOL = 1e-4, 1e-5  # fp32 rounding, as in test_engine_parity.py
DIM = 64  # LinearStack: 64 x 64 weights, a multiple of FlatLayout's alignment x 4 ranks
LAYERS = 4


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {"overlap_off": (_train_tiny, False)} for ws in WORLD_SIZES}
    cases[2] |= {f"staging_stage{stage}": (_staging_variants, stage) for stage in (2, 3)}
    cases[2]["bf16_copy"] = (_train_stack, 2, False, True)
    cases[1]["checkpointed"] = (_checkpointed,)  # last: its engines stop in the middle of a backward
    return SharedRuns(cases)


def _config(stage, overlap, bucket=700, extras=None, precision="fp32", gas=GAS):
    return engine_config(stage, gas=gas, clip=CLIP, precision=precision, zeroshard=extras,
                         zero={"reduce_bucket_size": bucket, "overlap_comm": overlap,
                               "stage3_param_persistence_threshold": 0})


def _train_tiny(rank, world_size, overlap):
    import zeroshard

    results = {}
    for stage in (0, 1, 2, 3):
        model = make_model()
        engine = zeroshard.initialize(model, _config(stage, overlap))
        losses = train_global_batches(model, engine, rank, world_size, range(STEPS), MICRO)
        results[stage] = (losses, engine.full_state_dict())
    return results if rank == 0 else None


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_overlap_comm_off_trains_like_single_process_adamw(runs, world_size):
    ref_losses, ref_state = adamw_reference(STEPS, MICRO * world_size * GAS, clip=CLIP)
    results = runs.result(world_size, "overlap_off")[0]
    for stage, (losses, state) in results.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} losses"
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"stage {stage}, {name}: {m}")


class LinearStack(torch.nn.Module):
    """LAYERS bias-free DIM x DIM layers: with reduce_bucket_size DIM * DIM every bucket (and at
    stage 3 every unit) is one layer, all the same size and none padded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _train_stack(rank, world_size, stage, overlap, bf16, cap=None):
    import zeroshard

    model = LinearStack()
    extras = {"reduce_dtype": "fp32"} if bf16 else {}
    if cap is not None:
        extras["max_inflight_reductions"] = cap
    config = _config(stage, overlap, bucket=DIM * DIM, extras=extras, precision="bf16" if bf16 else "fp32")
    engine = zeroshard.initialize(model, config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    peaks = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        for _ in range(GAS):
            x = torch.randn(MICRO, DIM, generator=gen).to(dtype)
            engine.backward(model(x).float().square().mean())
            engine.step()
        peaks.append(engine.memory_stats()["staging_peak"])
    calls = engine.comm_stats()["reduce_scatter"]["calls"]
    return peaks, calls, {k: v.float() for k, v in engine.full_state_dict().items()}


# (overlap_comm, zeroshard.max_inflight_reductions); None: the default cap, 2.
STAGING_VARIANTS = [(False, None), (True, 1), (True, None), (True, 3)]


def _staging_variants(rank, world_size, stage):
    return [_train_stack(rank, world_size, stage, overlap, False, cap) for overlap, cap in STAGING_VARIANTS]


@pytest.mark.parametrize("stage", [2, 3])
def test_staging_is_bounded_by_the_reductions_in_flight(runs, stage):
    """fp32, 2 ranks, four equal one-layer buckets (units). overlap_comm off holds one layer's
    staging buffer at a time (its 16 KB, exactly). On, at most max_inflight_reductions
    reductions hold theirs while the next bucket fills its own: (cap + 1) layers at most, on
    Gloo too, whose reduce-scatter never reports completion before wait() (so without the cap
    every layer's buffer lived until backward ended). At least two: the previous layer's
    reduction is still held when the next one starts filling. The weights are bitwise the same."""
    layer_bytes = DIM * DIM * 4
    results = runs.result(2, f"staging_stage{stage}")
    for rank in range(2):
        _, _, reference = results[rank][0]
        for (overlap, cap), (peaks, calls, state) in zip(STAGING_VARIANTS, results[rank]):
            what = f"rank {rank}, overlap {overlap}, cap {cap}"
            assert calls == LAYERS * GAS, f"{what}: one bucket (unit) per layer, reduced every micro-batch"
            if not overlap:
                assert peaks == [layer_bytes, layer_bytes], f"{what}: {peaks}"
            else:
                bound = ((cap or 2) + 1) * layer_bytes
                assert all(2 * layer_bytes <= p <= bound for p in peaks), f"{what}: {peaks}, bound {bound}"
                if cap == 1:
                    assert peaks == [2 * layer_bytes] * 2, f"{what}: {peaks}"
            for name in reference:
                assert torch.equal(state[name], reference[name]), f"{what}, {name}"


def test_overlap_comm_off_counts_the_fp32_copy_of_bf16_gradients(runs):
    """bf16 with reduce_dtype fp32 at stage 2: a bucket's bf16 staging buffer and its fp32 copy
    exist together while the copy is made (2 + 4 bytes per element), and nothing more."""
    peaks, _, _ = runs.result(2, "bf16_copy")[0]
    assert peaks == [DIM * DIM * 6] * 2, peaks


class SharedTwice(torch.nn.Module):
    """One bias-free layer applied twice, each time inside an activation checkpoint."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(DIM, DIM, bias=False)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for _ in range(2):
            x = checkpoint(lambda t: torch.tanh(self.layer(t)), x, use_reentrant=self.reentrant)
        return x


def _checkpointed(rank, world_size):
    import zeroshard

    x = torch.randn(MICRO, DIM, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    for stage in (0, 1, 2):
        # Reentrant: each checkpoint's nested backward accumulates the layer's gradient, the
        # second time after the bucket (the layer alone) has started its reduction.
        model = SharedTwice(reentrant=True)
        engine = zeroshard.initialize(model, _config(stage, overlap=True, gas=1))
        with pytest.raises(RuntimeError, match=r"'layer.weight' received a second gradient .*use_reentrant=False"):
            engine.backward(model(x).square().mean())

    # Not reentrant: one accumulation per backward, and the step is AdamW's on the whole batch.
    model, reference = SharedTwice(reentrant=False), SharedTwice(reentrant=False)
    engine = zeroshard.initialize(model, _config(1, overlap=True, gas=1))
    engine.backward(model(x).square().mean())
    engine.step()
    AdamWReference(reference, clip=CLIP, loss=lambda m, batch: m(batch).square().mean()).step(x)
    torch.testing.assert_close(engine.full_state_dict()["layer.weight"], reference.layer.weight.detach(),
                               rtol=RTOL, atol=ATOL)
    return True


def test_a_second_gradient_after_the_reduction_started_is_an_error(runs):
    """Stages 0 and 1 reduce the flat gradients in place: a gradient accumulated into a bucket
    whose reduction is running would race with it and be lost, so it is refused, as at stages
    2 and 3, with the way out in the message."""
    assert runs.result(1, "checkpointed") == [True]
