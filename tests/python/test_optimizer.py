"""The sharded AdamW step (csrc/zeroshard/optimizer.*): what a step allocates.

Gradient clipping needs the global norm. Computing it by casting each gradient shard to double
first would hold 8 more bytes per element for a moment (at stage 0 a whole copy of the
gradients, in double): on a GPU, half again the 16 bytes per parameter of model state. The
step is profiled op by op, so the check holds on any machine and depends on no timing. The
cases share one spawned pair of ranks (spawn.SharedRuns), each with its own result and failure.
"""

import pytest
import torch

from spawn import SharedRuns
from training import engine_config

DIM = 512
LAYERS = 4
CONVERTED = [(1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16")]  # (stage, precision)


@pytest.fixture(scope="module")
def runs():
    cases = {f"conversions_stage{stage}": (_step_conversions, stage) for stage in (0, 2)}
    cases |= {f"converted_peak_stage{stage}_{precision}": (_converted_peak, stage, precision)
              for stage, precision in CONVERTED}
    cases["fp32_peak"] = (_fp32_peak,)
    return SharedRuns({2: cases})


def _config(stage, **options):
    """AdamW at lr 1e-3 with clipping at 0.5, the engine's timeout."""
    return engine_config(stage, lr=1e-3, weight_decay=None, clip=0.5, timeout=None, **options)


def _step_conversions(rank, world_size, stage):
    import zeroshard
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM, bias=False), torch.nn.Linear(DIM, DIM, bias=False))
    engine = zeroshard.initialize(model, _config(stage, zero={"reduce_bucket_size": DIM * DIM}))
    x = torch.randn(2, DIM)
    engine.backward(model(x).square().mean())
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.step()
    norm = float(engine.last_grad_norm)
    # Every dtype conversion the step made, by the shape of what it converted.
    shapes = [e.input_shapes[0] for e in prof.key_averages(group_by_input_shape=True)
              if e.key == "aten::_to_copy"]
    return norm, shapes


@pytest.mark.parametrize("stage", [0, 2])
def test_clipping_converts_no_gradient(runs, stage):
    """fp32 with clipping: the only conversions of a step are of scalars (the norm), none of a
    gradient; and the norm is the one torch computes."""
    results = runs.result(2, f"conversions_stage{stage}")
    for norm, shapes in results:
        assert shapes, "the profiler saw no conversion at all (the norm's own is expected)"
        assert all(torch.Size(s).numel() <= 1 for s in shapes), shapes
    torch.manual_seed(0)  # the ranks' model and batch (the same on both: the mean gradient is theirs)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM, bias=False), torch.nn.Linear(DIM, DIM, bias=False))
    model(torch.randn(2, DIM)).square().mean().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for norm, _ in results:
        assert norm == pytest.approx(expected, rel=1e-5)



def _converted_peak(rank, world_size, stage, precision):
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])
    # A bucket (stages 1-2) or a unit (stage 3, every layer) per layer.
    config = _config(stage, precision=precision,
                     zero={"reduce_bucket_size": DIM * DIM, "stage3_param_persistence_threshold": 0},
                     zeroshard={"stage3_unit_classes": ["Linear"]} if stage == 3 else None)
    engine = zeroshard.initialize(model, config)
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank)).to(next(model.parameters()).dtype)
    peaks = []
    for _ in range(2):
        engine.backward(model(x).float().square().mean())
        engine.step()
        peaks.append(engine.memory_stats()["fp32_grads_peak"])
    return peaks, engine.skipped_steps


@pytest.mark.parametrize("stage,precision", CONVERTED)
def test_16_bit_gradients_become_fp32_one_shard_at_a_time(runs, stage, precision):
    """The step (with clipping, and fp16's unscale) makes fp32 copies of the 16-bit gradient
    shards one at a time: the most alive at once is one layer's shard, 4 bytes per element,
    not all of them."""
    shard_bytes = DIM * DIM // 2 * 4
    for peaks, skipped in runs.result(2, f"converted_peak_stage{stage}_{precision}"):
        assert skipped == 0
        assert peaks == [shard_bytes, shard_bytes], peaks


def _fp32_peak(rank, world_size):
    import zeroshard

    model = torch.nn.Linear(DIM, DIM, bias=False)
    engine = zeroshard.initialize(model, _config(2))
    engine.backward(model(torch.randn(2, DIM)).square().mean())
    engine.step()
    return engine.memory_stats()["fp32_grads_peak"]


def test_fp32_gradients_are_not_copied(runs):
    assert runs.result(2, "fp32_peak") == [0, 0]
