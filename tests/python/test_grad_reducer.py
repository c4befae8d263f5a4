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
    cases[2]["one_rank_uses"] = (_one_rank_uses,)
    cases[2]["sparse"] = (_sparse_against_dense,)
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


class Routed(torch.nn.Module):
    """An embedding (sparse or dense), a shared layer, and a layer only rank 1's batches use (as
    an MoE expert or a branch one rank does not take)."""

    def __init__(self, sparse=False):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(32, 16, sparse=sparse)
        self.shared = torch.nn.Linear(16, 16)
        self.branch = torch.nn.Linear(16, 16)

    def loss(self, tokens, use_branch):
        x = torch.tanh(self.shared(self.embedding(tokens)))
        if use_branch:
            x = self.branch(x)
        return x.pow(2).mean()


def _routed_batch(step, rank):
    return torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(100 * step + rank))


def _one_rank_uses(rank, world_size):
    """Stages 0 and 1: after a boundary backward every parameter's .grad holds the mean over
    ranks, the one this rank did not use included (Note [first gradient of a window])."""
    import zeroshard

    out = {}
    for stage in (0, 1):
        model = Routed()
        # One bucket: buckets launch as they fill, so with several a layer one rank skips would
        # put its bucket's reduction in another place on each rank.
        engine = zeroshard.initialize(model, engine_config(stage, gas=1, zero={"reduce_bucket_size": 10**6}))
        engine.backward(model.loss(_routed_batch(0, rank), use_branch=rank == 1))
        out[stage] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return out


def _sparse_against_dense(rank, world_size):
    """Every stage trains nn.Embedding(sparse=True) as its dense twin (two windows of two
    micro-batches)."""
    import zeroshard

    out = {}
    for stage in (0, 1, 2, 3):
        for sparse in (False, True):
            model = Routed(sparse)
            engine = zeroshard.initialize(model, engine_config(stage, gas=2))
            for step in range(4):
                engine.backward(model.loss(_routed_batch(step, rank), use_branch=True))
                engine.step()
            out[(stage, sparse)] = engine.full_state_dict()
    return out


def test_a_parameter_one_rank_did_not_use_has_the_reduced_gradient_on_every_rank(runs):
    ranks = runs.result(2, "one_rank_uses")
    for stage in (0, 1):
        grads = [r[stage] for r in ranks]
        for name in grads[1]:
            assert grads[0][name] is not None, f"stage {stage}: rank 0's {name}.grad is None"
            # Stage 0 all-reduces, so every rank holds the mean; stage 1 reduce-scatters, so only
            # each rank's shard is reduced: the branch's gradient on rank 0 is then rank 1's / 2
            # in rank 0's shard and zeros or rank 1's own elsewhere. Stage 0 is exact.
            if stage == 0:
                torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0,
                                           msg=lambda m: f"{name}: {m}")
    assert ranks[0][0]["branch.weight"].abs().sum() > 0  # stage 0: rank 1's gradient reached rank 0


def test_sparse_embedding_gradients_train_as_dense_ones_at_every_stage(runs):
    for state in runs.result(2, "sparse"):
        for stage in (0, 1, 2, 3):
            dense, sparse = state[(stage, False)], state[(stage, True)]
            for name in dense:
                torch.testing.assert_close(sparse[name], dense[name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"stage {stage}, {name}: {m}")
