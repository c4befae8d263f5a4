"""Frozen parameters (a LoRA base): sharded with their units at stage 3, whole below it, never
trained, the same on every rank (Note [frozen parameters] in stage3/unit_builder.cpp).

The model is tests/python/models.py's LoraTransformer: every base weight frozen, adapters on
each block's projections trained. Its adapters' backward runs before the base weight's
input-gradient matmul, so releasing a unit once its trained gradients are reduced would read a
freed weight (Note [release after backward]). The peft models are tests/python/test_lora.py's;
checkpoints, exports, pretrained loads and meta init of the frozen base are test_frozen_state.py's.
"""

import pytest
import torch

from frozen_runs import PERSIST, STEPS, config as _config, frozen_state as _frozen_state
from model_state import padded_numel
from spawn import SharedRuns
from training import LR, WEIGHT_DECAY, train_global_batches


def _train(rank, world_size, stage, base_dtype, zero=None):
    """The adapters after STEPS, the losses, the frozen base before and after (whole), and the
    engine's byte counts. Every rank but 0 builds its base from another seed: initialize makes
    every rank start from rank 0's."""
    import zeroshard
    from models import make_lora_model

    model = make_lora_model(seed=rank, base_dtype=base_dtype)
    engine = zeroshard.initialize(model, _config(stage, zero=zero or {}))
    with engine.gathered_parameters():
        before = _frozen_state(model)
    losses = train_global_batches(model, engine, rank, world_size, STEPS)
    with engine.gathered_parameters():
        after = _frozen_state(model)
        adapters = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return dict(losses=losses, adapters=adapters, before=before, after=after, stats=engine.memory_stats(),
                units=engine.stage3_units(), comm=engine.comm_stats(), plan=engine.plan(),
                dtypes={n: p.dtype for n, p in model.named_parameters()},
                sizes={n: p.numel() for n, p in model.named_parameters()})


def _reference_run(base_dtype, world_size):
    from models import global_batch, make_lora_model
    from training import MICRO

    torch.manual_seed(0)
    model = make_lora_model(seed=0, base_dtype=base_dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trained, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in STEPS:
        loss = model.loss(global_batch(step, MICRO * world_size))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def _broadcast_check(rank, world_size):
    """Buffers and whole frozen parameters (below stage 3) also start from rank 0's."""
    import zeroshard
    from models import make_lora_model

    model = make_lora_model(seed=rank)
    model.register_buffer("scale", torch.full((3,), float(rank)))
    engine = zeroshard.initialize(model, _config(2))
    return {n: t.clone() for n, t in list(model.named_buffers()) + list(_frozen_state(model).items())}, engine.stage


CASES = {ws: {f"stage{stage}-{dtype}": (_train, stage, dtype)
              for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)}
         for ws in (1, 2, 4)}
CASES[4]["stage3-hpz"] = (_train, 3, torch.bfloat16, {"zero_hpz_partition_size": 2})
CASES[2]["stage3-offload"] = (_train, 3, torch.float32, {"offload_param": {"device": "cpu"}})
CASES[2]["broadcast"] = (_broadcast_check,)


def _checkpointed(rank, world_size, reentrant):
    """Activation checkpointing: a block's forward runs again inside its backward (hooks on the
    recomputed forward's inputs, too), and the block is still released after its backward."""
    import zeroshard
    from models import CheckpointedLoraTransformer

    torch.manual_seed(0)  # as make_lora_model(seed=0)
    model = CheckpointedLoraTransformer(reentrant=reentrant, base_dtype=torch.bfloat16, layers=6)
    engine = zeroshard.initialize(model, _config(3))
    losses = train_global_batches(model, engine, rank, world_size, STEPS)
    with engine.gathered_parameters():
        adapters = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    units = engine.stage3_units()
    return dict(losses=losses, adapters=adapters, peak=engine.memory_stats()["gathered_peak"], units=units,
                sizes={n: p.numel() for n, p in model.named_parameters()})


for _reentrant in (False, True):
    CASES[2][f"checkpointed-{_reentrant}"] = (_checkpointed, _reentrant)
RUNS = SharedRuns(CASES)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-base", "bf16-base"])
def test_adapters_match_adamw_and_the_frozen_base_is_untouched(world_size, stage, dtype):
    results = RUNS.result(world_size, f"stage{stage}-{dtype}")
    ref_losses, ref_adapters = _reference_run(dtype, world_size)
    # A bf16 base computes in bf16: a CPU may block the fp32 accumulation of a half batch's
    # matmuls differently from the whole batch's (oneDNN with AVX512-BF16 does, on an AMD EPYC),
    # so activations round differently, and AdamW's normalised update carries that into the
    # adapters (up to 5e-4 relative after 3 steps at 2 ranks there); fp32 stays at fp32 rounding.
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-3, 2e-4)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-4), f"rank {rank}"
        for name, value in ref_adapters.items():
            torch.testing.assert_close(r["adapters"][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m, name=name, rank=rank: f"{name} rank {rank}: {m}")
        # Bitwise: a frozen weight is never written, and every rank holds rank 0's.
        for name, value in results[0]["before"].items():
            assert torch.equal(r["before"][name], value), f"{name}: rank {rank} did not start from rank 0's"
            assert torch.equal(r["after"][name], value), f"{name} changed in training on rank {rank}"
            assert r["after"][name].dtype == dtype, f"{name} is not kept in its own dtype"


def _frozen_formula(result, stage, world_size):
    """Bytes of frozen parameters one rank holds: whole below stage 3; at stage 3 each unit's
    frozen parameters over the persistence threshold padded and sharded per dtype, the rest whole."""
    dtypes, sizes = result["dtypes"], result["sizes"]
    frozen = [n for n in result["before"]]
    whole = sum(sizes[n] * dtypes[n].itemsize for n in frozen)
    if stage < 3:
        return whole
    total = sum(sizes[n] * dtypes[n].itemsize for n in frozen if sizes[n] <= PERSIST)
    for unit in result["units"]:
        by_dtype = {}
        for name in unit["frozen"]:
            by_dtype[dtypes[name]] = by_dtype.get(dtypes[name], 0) + sizes[name]
        for dtype, numel in by_dtype.items():
            total += padded_numel(numel, world_size) // world_size * dtype.itemsize
    return total


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_bytes_per_rank_are_the_formula(world_size, stage):
    r = RUNS.result(world_size, f"stage{stage}-{torch.bfloat16}")[0]
    stats = r["stats"]
    assert stats["frozen"] == _frozen_formula(r, stage, world_size)
    assert stats["total"] == stats["params"] + stats["grads"] + stats["optimizer"] + stats["frozen"]
    assert stats["device_frozen"] == stats["frozen"] and stats["host_frozen"] == 0
    frozen_line = r["plan"].splitlines()[-1]
    assert frozen_line.startswith("frozen parameters: " + ("sharded" if stage == 3 else "replicated")), r["plan"]
    if stage == 3:
        listed = {n for unit in r["units"] for n in unit["frozen"]}
        assert listed == {n for n in r["before"] if r["sizes"][n] > PERSIST}
        whole = sum(r["sizes"][n] * r["dtypes"][n].itemsize for n in r["before"])
        if world_size > 1:
            assert stats["frozen"] < whole * 0.75  # sharded, not whole


def test_stage3_gathers_frozen_parameters_with_their_unit():
    """The gathered peak and the all-gather traffic include the frozen buffers."""
    r = RUNS.result(2, f"stage3-{torch.bfloat16}")[0]
    frozen_unit_bytes = []
    for unit in r["units"]:
        by_dtype = {}
        for name in unit["frozen"]:
            by_dtype[r["dtypes"][name]] = by_dtype.get(r["dtypes"][name], 0) + r["sizes"][name]
        frozen_unit_bytes.append(sum(padded_numel(n, 2) * d.itemsize for d, n in by_dtype.items()))
    assert r["stats"]["gathered_peak"] >= max(frozen_unit_bytes) > 0
    assert r["comm"]["all_gather"]["bytes"] >= sum(frozen_unit_bytes)


def test_hpz_and_offloaded_shards_hold_frozen_parameters_too():
    for name, world_size in (("stage3-hpz", 4), ("stage3-offload", 2)):
        results = RUNS.result(world_size, name)
        dtype = torch.bfloat16 if name == "stage3-hpz" else torch.float32
        ref_losses, ref_adapters = _reference_run(dtype, world_size)
        for r in results:
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-4), name
            for n, value in ref_adapters.items():
                torch.testing.assert_close(r["adapters"][n], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")
            for n, value in results[0]["before"].items():
                assert torch.equal(r["after"][n], value), f"{name}: {n} changed"
    stats = RUNS.result(2, "stage3-offload")[0]["stats"]
    assert stats["host_frozen"] > 0 and stats["host_frozen"] == stats["frozen"] - stats["device_frozen"]
    hpz = RUNS.result(4, "stage3-hpz")[0]
    # hpZ keeps 1/2 of every unit released after forward: frozen buffers included.
    assert hpz["stats"]["secondary_peak"] >= sum(padded_numel(sum(hpz["sizes"][n] for n in u["frozen"]), 4) // 2 * 2
                                                for u in hpz["units"] if not u["root"]) > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_releases_each_block_after_its_backward(reentrant):
    from models import global_batch, make_lora_model
    from training import MICRO

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16, layers=6)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    ref = []
    for step in STEPS:
        loss = model.loss(global_batch(step, MICRO * 2))
        optim.zero_grad()
        loss.backward()
        optim.step()
        ref.append(loss.item())
    for r in RUNS.result(2, f"checkpointed-{reentrant}"):
        assert r["losses"] == pytest.approx(ref, rel=1e-4)
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(r["adapters"][n], p.detach().float(), rtol=1e-4, atol=1e-5, msg=n)
        # Gathered at once: the root and two of the six blocks (the one in backward and the
        # next, prefetched; the first is released by the gradient hook on the view of its input
        # before the next one's backward starts and prefetches), as without checkpointing;
        # held to the end of the backward, all six would be.
        gathered = [padded_numel(u["numel"], 2) * 4 + padded_numel(u["frozen_numel"], 2) * 2 for u in r["units"]]
        root = [g for g, u in zip(gathered, r["units"]) if u["root"]][0]
        block = max(g for g, u in zip(gathered, r["units"]) if not u["root"])
        assert len(gathered) == 7 and r["peak"] <= root + 2 * block, (r["peak"], root, block)


def test_buffers_and_whole_frozen_parameters_start_from_rank_0s():
    results = RUNS.result(2, "broadcast")
    for name, value in results[0][0].items():
        assert torch.equal(results[1][0][name], value), name
    assert torch.equal(results[1][0]["scale"], torch.zeros(3))


def _batches(step, rank, world_size):
    from models import global_batch

    tokens = global_batch(step, 4 * world_size)
    return tokens[4 * rank:4 * rank + 2], tokens[4 * rank + 2:4 * rank + 4]


def _two_forwards_case(rank, world_size):
    """Two forwards (two losses summed) before one backward: each unit holding frozen weights
    waits for both forwards' input gradients."""
    import zeroshard
    from models import make_lora_model

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    engine = zeroshard.initialize(model, _config(3, micro=4))
    for step in STEPS:
        first, second = _batches(step, rank, world_size)
        engine.backward(model.loss(first) + model.loss(second))
        engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


CASES[2]["two_forwards"] = (_two_forwards_case,)
RUNS = SharedRuns(CASES)


def test_two_forwards_before_one_backward_match_adamw():
    from models import make_lora_model

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    for step in STEPS:
        loss = sum(model.loss(first) + model.loss(second) for first, second in
                   (_batches(step, rank, 2) for rank in range(2))) / 2
        optim.zero_grad()
        loss.backward()
        optim.step()
    for adapters in RUNS.result(2, "two_forwards"):
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(adapters[n], p.detach().float(), rtol=1e-4, atol=1e-5, msg=n)
