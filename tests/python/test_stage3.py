"""Stage 3: parameters live as shards between uses.

Each case trains a variant of the tiny transformer with zeroshard at stage 3 and compares the
losses and final parameters with single-process torch.optim.AdamW on the same global batch
(fp32 rounding: rtol 1e-4, atol 1e-5), then checks what stage 3 promises about memory and
traffic with the engine's own accounting. The cases share one spawned run per world size
(spawn.SharedRuns), each with its own result and failure.
"""

import pytest
import torch
import torch.nn as nn

from conftest import WORLD_SIZES
from model_state import model_state_bytes, padded_numel, stage3_unit_numels
from models import Block, TinyTransformer, global_batch
from spawn import SharedRuns
from training import MICRO, AdamWReference, engine_config, train_global_batches

STEPS = 3
UNITS_THRESHOLD = 40  # stage3_param_persistence_threshold of test_stage3_units_lists_...
PREFETCH_LAYERS = 4  # blocks of test_each_blocks_backward_finds_the_next_block_gathered_ahead


class SkipBlock(Block):
    """A block whose `extra` layer runs only when `use_extra` is set: on the other steps that
    parameter of the unit gets no gradient."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.extra = nn.Linear(dim, dim)
        self.use_extra = True

    def forward(self, x):
        x = super().forward(x)
        return x + 0.1 * self.extra(x) if self.use_extra else x


class Variant(TinyTransformer):
    """tie: the head shares the embedding's weight. twice: block 0 runs twice per forward.
    frozen: block 1's up-projection is frozen. skip: a block parameter is used only on even
    steps (set .step), so on odd steps it gets no gradient."""

    def __init__(self, tie=False, twice=False, frozen=False, skip=False):
        torch.manual_seed(0)
        super().__init__()
        self.twice, self.skip_on_odd, self.step = twice, skip, 0
        if tie:
            self.head.weight = self.embed.weight
        if frozen:
            for p in self.blocks[1].up.parameters():
                p.requires_grad_(False)
        if skip:
            self.blocks[0] = SkipBlock(self.embed.embedding_dim, self.blocks[0].up.out_features)

    def forward(self, tokens):
        x = self.embed(tokens)
        order = [self.blocks[0]] + list(self.blocks) if self.twice else list(self.blocks)
        if self.skip_on_odd:
            self.blocks[0].use_extra = self.step % 2 == 0
        for block in order:
            x = block(x)
        x = self.norm(x)
        return self.head(x) + self.gate(x) * self.odd[: self.vocab]


def _config(gas=1, reshard=True, **zero):
    return engine_config(3, gas=gas, zero={"stage3_param_persistence_threshold": 0, **zero},
                         zeroshard={"reshard_after_forward": reshard})


def _before_step(model, evals, rows):
    """Sets model.step; with `evals` a list, appends the loss of the batch's `rows` computed
    under no_grad: an eval forward between steps."""

    def before_step(step, tokens):
        model.step = step
        if evals is not None:
            with torch.no_grad():
                evals.append(model.loss(tokens[rows]).item())

    return before_step


def _train(rank, world_size, variant, config, eval_forward):
    import zeroshard

    model = Variant(**variant)
    engine = zeroshard.initialize(model, config)
    evals = [] if eval_forward else None
    losses = train_global_batches(model, engine, rank, world_size, range(STEPS),
                                  before_step=_before_step(model, evals, slice(rank * MICRO, (rank + 1) * MICRO)))
    state = engine.full_state_dict()
    # Released again after the state dict: only shards remain between steps.
    stats = engine.memory_stats()
    return losses, evals or [], state, stats, engine.comm_stats()


def _reference(world_size, variant, gas, eval_forward):
    model = Variant(**variant)
    reference = AdamWReference(model)  # a parameter with no gradient counts as a zero gradient
    evals = [] if eval_forward else None
    before_step = _before_step(model, evals, slice(0, MICRO))  # rank 0's rows
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step, MICRO * world_size * gas)
        before_step(step, tokens)
        losses.append(reference.step(tokens))
    return losses, evals or [], model.state_dict()


def _trained(world_size):
    """The training cases at world_size: name -> (variant, config, gas, eval_forward)."""
    cases = {f"tied_{how}": ({"tie": True}, _config(reshard=how == "reshard"), 1, False)
             for how in ("reshard", "keep_after_forward")}
    if world_size > 1:
        cases["memory"] = ({}, _config(), 1, False)
    if world_size == 2:
        cases["accumulation"] = ({"tie": True}, _config(gas=2), 2, False)
        cases |= {variant: ({variant: True}, _config(), 1, False) for variant in ("twice", "frozen", "skip")}
        cases["eval_forward"] = ({}, _config(), 1, True)
        *blocks, root = stage3_unit_numels(Variant(), world_size)
        cases["max_live"] = ({}, _config(stage3_max_live_parameters=root + max(blocks)), 1, False)
        cases["max_live_zero"] = ({}, _config(stage3_max_live_parameters=0), 1, False)
        cases["no_prefetch"] = ({}, _config(stage3_prefetch_bucket_size=0), 1, False)
        cases["prefetch_size_1"] = ({}, _config(stage3_prefetch_bucket_size=1), 1, False)
    return cases


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {name: (_train, variant, config, eval_forward)
                  for name, (variant, config, _, eval_forward) in _trained(ws).items()} for ws in WORLD_SIZES}
    cases[2]["units"] = (_units, UNITS_THRESHOLD)
    cases[2]["backward_prefetch"] = (_backward_prefetch,)
    cases[2]["order_mismatch"] = (_order_mismatch,)  # last: its engines stop in the middle of a backward
    return SharedRuns(cases)


def _check_against_reference(runs, world_size, name):
    variant, _, gas, eval_forward = _trained(world_size)[name]
    results = runs.result(world_size, name)
    ref_losses, ref_evals, ref_state = _reference(world_size, variant, gas, eval_forward)
    losses, evals, state, _, _ = results[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if eval_forward:
        assert evals == pytest.approx(ref_evals, rel=1e-5)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reshard", ["reshard", "keep_after_forward"])
def test_tied_weights_match_single_process_adamw(runs, world_size, reshard):
    _check_against_reference(runs, world_size, f"tied_{reshard}")


@pytest.mark.parametrize("world_size", [2])
def test_accumulation_matches(runs, world_size):
    _check_against_reference(runs, world_size, "accumulation")


@pytest.mark.parametrize("variant", ["twice", "frozen", "skip"])
def test_special_cases_match(runs, variant):
    _check_against_reference(runs, 2, variant)


def test_eval_forward_under_no_grad_between_steps(runs):
    _check_against_reference(runs, 2, "eval_forward")


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_and_traffic_follow_stage3_formulas(runs, world_size):
    """Between steps each rank holds 16Ψ/N bytes, padding included (fp32 shards of params and
    grads, exp_avg and exp_avg_sq: a unit of one param group is one optimizer slot over its
    whole shard, as a stage-2 bucket is); a step moves two all-gathers and one reduce-scatter per
    block unit and one of each for the root unit; at most two blocks are gathered at once."""
    results = runs.result(world_size, "memory")
    padded = stage3_unit_numels(Variant(), world_size)  # the blocks, then the root
    blocks = len(padded) - 1
    total_padded = sum(padded)
    expected = model_state_bytes(3, world_size, total_padded)
    optimizer_bytes = []
    for _, _, _, mem, comm in results:
        assert mem["params"] == mem["grads"] == expected["params"] == expected["grads"]
        optimizer_bytes.append(mem["optimizer"])
        assert mem["optimizer"] == expected["optimizer"]
        gathered = 4 * sum(padded)
        block_bytes = 4 * sum(padded[:-1])
        assert comm["all_gather"] == {"calls": 2 * blocks + 1, "bytes": gathered + block_bytes}
        assert comm["reduce_scatter"] == {"calls": blocks + 1, "bytes": gathered}
        assert comm["all_reduce"]["calls"] == comm["broadcast"]["calls"] == 0
        # Root stays gathered through the step; prefetch keeps at most two blocks beside it.
        assert 4 * padded[-1] < mem["gathered_peak"] <= 4 * (padded[-1] + 2 * max(padded[:-1]))
    # Optimizer state covers every element of the padded units exactly once across the ranks:
    # together the ranks hold what one rank would alone.
    assert sum(optimizer_bytes) == model_state_bytes(3, 1, total_padded)["optimizer"]


def _order_mismatch(rank, world_size):
    import zeroshard

    model = Variant()
    engine = zeroshard.initialize(model, _config())
    if rank == 1:
        model.blocks = nn.ModuleList(reversed(list(model.blocks)))
    tokens = global_batch(0, MICRO * world_size)
    try:
        engine.backward(model.loss(tokens[rank * MICRO:(rank + 1) * MICRO]))
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_running_units_in_different_orders_get_a_clear_error(runs):
    messages = runs.result(2, "order_mismatch")
    for message in messages:
        assert message is not None and "every rank must run the units in the same order" in message
        assert "blocks.0" in message or "blocks.1" in message


@pytest.mark.parametrize("limit", ["max_live", "max_live_zero", "no_prefetch"])
def test_live_and_prefetch_limits_bound_gathered_memory(runs, limit):
    """stage3_max_live_parameters (here: the root plus one block, or 0: DeepSpeed's "nothing
    prefetched past the unit in use") and stage3_prefetch_bucket_size = 0 each stop the
    prefetch, so at most one block is gathered beside the root; the numbers do not change."""
    world_size = 2
    *blocks, root = stage3_unit_numels(Variant(), world_size)
    results = _check_against_reference(runs, world_size, limit)  # the limits: _trained()
    for _, _, _, mem, _ in results:
        assert mem["gathered_peak"] == 4 * (root + max(blocks))


def test_a_unit_larger_than_the_prefetch_size_is_still_prefetched(runs):
    """As DeepSpeed always fetches the head of its prefetch queue: a prefetch size of one
    element still gathers the next block while the current one computes (only 0 turns it
    off), so two blocks are gathered beside the root at the peak."""
    world_size = 2
    *blocks, root = stage3_unit_numels(Variant(), world_size)
    results = _check_against_reference(runs, world_size, "prefetch_size_1")
    for _, _, _, mem, _ in results:
        assert mem["gathered_peak"] > 4 * (root + max(blocks))


def _backward_prefetch(rank, world_size):
    """Per step, for each block but the first: whether, when the gradient reaches the block's
    output (a hook registered after the engine's own), the block before it, whose backward
    runs next, had been gathered ahead already (its parameters have storage)."""
    import zeroshard

    torch.manual_seed(0)
    model = TinyTransformer(layers=PREFETCH_LAYERS)
    engine = zeroshard.initialize(model, _config())
    blocks = list(model.blocks)
    seen = []

    def watch(i):
        def on_output(_module, _args, out):
            if out.requires_grad:
                previous = next(blocks[i - 1].parameters())
                out.register_hook(lambda _grad: seen[-1].append((i, previous.untyped_storage().nbytes() > 0)))
        return on_output

    for i in range(1, len(blocks)):
        blocks[i].register_forward_hook(watch(i))
    for step in range(STEPS):
        seen.append([])
        tokens = global_batch(step, MICRO * world_size)[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(model.loss(tokens))
        engine.step()
    return seen


def test_each_blocks_backward_finds_the_next_block_gathered_ahead(runs):
    """The root unit (embedding, norm, head) starts its forward before the blocks and ends it
    after them, as in every real model. From the second step on (the first records the order),
    backward prefetches along the order the forwards ended in, reversed: when block i's
    backward starts, block i-1 is being gathered already, on every rank."""
    for seen in runs.result(2, "backward_prefetch"):
        blocks = PREFETCH_LAYERS
        expected_blocks = list(range(blocks - 1, 0, -1))
        assert [[i for i, _ in step] for step in seen] == [expected_blocks] * STEPS
        assert [ready for _, ready in seen[0]] == [False] * (blocks - 1)
        for step in seen[1:]:
            assert [ready for _, ready in step] == [True] * (blocks - 1)


def _units(rank, world_size, threshold):
    import zeroshard

    model = Variant(tie=True)
    engine = zeroshard.initialize(model, _config(stage3_param_persistence_threshold=threshold))
    below = zeroshard.initialize(Variant(), {**_config(), "zero_optimization": {"stage": 2}})
    return engine.stage3_units(), below.stage3_units(), engine.memory_stats()


def test_stage3_units_lists_each_unit_with_its_persistent_parameters(runs):
    """engine.stage3_units(): the blocks in order, then the root (everything else, the tied
    head/embedding included), each with the elements it gathers and releases and the parameters
    of at most stage3_param_persistence_threshold elements that stay gathered instead; the
    persistent ones cost a full copy on every rank (params at 2 ranks: the shards of the
    released units plus the whole persistent unit)."""
    threshold = UNITS_THRESHOLD
    units, below, mem = runs.result(2, "units")[0]
    model = Variant(tie=True)
    expected = []
    for name, module in [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)] + [("<root>", None)]:
        if module is None:
            in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
            params = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
        else:
            params = [(f"{name}.{n}", p) for n, p in module.named_parameters()]
        kept = [(n, p) for n, p in params if p.numel() <= threshold]
        released = [(n, p) for n, p in params if p.numel() > threshold]
        expected.append({"name": name, "numel": sum(p.numel() for _, p in released),
                         "params": [n for n, _ in released], "persistent": [n for n, _ in kept],
                         "persistent_numel": sum(p.numel() for _, p in kept), "root": module is None,
                         "frozen": [], "frozen_numel": 0})
    assert units == expected
    assert all(u["persistent"] for u in units), "the threshold keeps norms and biases of every unit"
    assert below == [], "below stage 3 there are no units"
    persistent = padded_numel(sum(u["persistent_numel"] for u in units), 2)
    released = sum(padded_numel(u["numel"], 2) for u in units)
    assert mem["params"] == model_state_bytes(3, 2, released + persistent, persistent=persistent)["params"]
