"""Models built on the meta device: initialize allocates only this rank's share and initialises
it module by module (csrc/zeroshard/state/meta_init.cpp, Note [meta initialisation]).

Held to: the same weights (fp32 masters and compute-dtype parameters, bitwise) and the same
memory_stats() as building the model normally with the same seed, at stages 0-3, fp32 and bf16,
on 1, 2 and 4 ranks; stage 3's bytes to the model-state formula; training on from there bitwise
as the normally built engine. One spawn per world size runs every case.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard
from model_state import model_state_bytes, stage3_unit_numels
from models import Block
from spawn import run_ranks
from training import engine_config, train_global_batches

CASES = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
SEED = 7


class OddVector(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.normal_(0.0, 0.1)


class Scaled(nn.Module):
    """A parameter and a buffer, both set by reset_parameters."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.register_buffer("scale", torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.uniform_(0.5, 1.5)
            self.scale.fill_(0.75)

    def forward(self, x):
        return x * self.weight * self.scale.to(x.dtype)


class MetaTransformer(nn.Module):
    """TinyTransformer's layout, built so that construction draws in named_modules() order (every
    parameter in a module with reset_parameters), plus a buffer its module's reset_parameters
    sets."""

    def __init__(self, vocab=37, dim=24, hidden=40, layers=2):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.stats = Scaled(dim)
        self.head = nn.Linear(dim, vocab)
        self.odd = OddVector(53)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        x = self.stats(x)
        return self.head(x) + self.odd.weight[: self.vocab]

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


def build(meta):
    torch.manual_seed(SEED)
    if not meta:
        return MetaTransformer()
    with torch.device("meta"):
        return MetaTransformer()


def config(stage, precision, persistence=0):
    zero = {"stage3_param_persistence_threshold": persistence} if stage == 3 else None
    return engine_config(stage, precision=precision, zero=zero)


def state_of(engine):
    return {"master": engine.full_state_dict(dtype=torch.float32), "compute": engine.full_state_dict(),
            "memory": {k: v for k, v in engine.memory_stats().items() if not k.endswith("_peak")}}


def parity_cases(rank, world):
    out = {}
    cases = [(stage, precision, 0) for stage, precision in CASES] + [(3, "bf16", 100)]
    for stage, precision, persistence in cases:
        engines = {}
        for meta in (False, True):
            model = build(meta)
            engine = zeroshard.initialize(model, config(stage, precision, persistence))
            before = state_of(engine)
            train_global_batches(model, engine, rank, world, steps=[0, 1])
            engines[meta] = (before, state_of(engine))
        devices = {str(t.device) for t in model.state_dict().values()}
        out[(stage, precision, persistence)] = {"normal": engines[False], "meta": engines[True], "devices": devices}
    return out


@functools.lru_cache(maxsize=None)
def parity_results(world):
    return run_ranks(parity_cases, world, timeout=120)[0]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage,precision,persistence", [(s, p, 0) for s, p in CASES] + [(3, "bf16", 100)])
def test_meta_model_equals_normal_build(world, stage, precision, persistence):
    case = parity_results(world)[(stage, precision, persistence)]
    (normal_init, normal_trained), (meta_init, meta_trained) = case["normal"], case["meta"]
    # The same as the model built normally with the same seed, in a single process.
    reference = build(meta=False).state_dict()
    for name, value in reference.items():
        assert torch.equal(meta_init["master"][name], value), name
    for kind in ("master", "compute"):
        for name, value in normal_init[kind].items():
            assert meta_init[kind][name].dtype == value.dtype, name
            assert torch.equal(meta_init[kind][name], value), (kind, name)
            assert torch.equal(meta_trained[kind][name], normal_trained[kind][name]), (kind, name)
    assert meta_init["memory"] == normal_init["memory"]
    assert case["devices"] == {"cpu"}
    if stage == 3 and persistence == 0:
        units = stage3_unit_numels(build(meta=False), world)
        expected = model_state_bytes(3, world, sum(units), precision)
        assert {k: meta_init["memory"][k] for k in ("params", "grads", "optimizer")} == expected


# Single-process and two-rank behaviours.

class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.inner(x) * self.scale


class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(6))


class Parent(nn.Module):
    """Its reset_parameters writes its child's parameter, which has no reset_parameters itself."""

    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.empty(5))
        self.child = Child()
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.own.uniform_()
            self.child.weight.normal_()


def behaviours(rank, world):
    out = {}
    cfg = engine_config(3, zero={"stage3_param_persistence_threshold": 0})
    with torch.device("meta"):
        raw = Raw()
    try:
        zeroshard.initialize(raw, cfg)
    except ValueError as e:
        out["raw"] = str(e)
    try:
        zeroshard.initialize(nn.Linear(3, 3), cfg, init_fn=lambda m: None)
    except ValueError as e:
        out["not_meta"] = str(e)

    # An init_fn is called with every module holding state; ones everywhere.
    with torch.device("meta"):
        model = Raw()
    seen = []

    def ones(module):
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            with torch.no_grad():
                p.fill_(1.0)

    engine = zeroshard.initialize(model, cfg, init_fn=ones)
    out["init_fn"] = (seen, {k: v.clone() for k, v in engine.full_state_dict().items()})

    # A parent's reset_parameters that writes its child's parameter: the step runs again with it.
    torch.manual_seed(3)
    normal = Parent()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = Parent()
    engine = zeroshard.initialize(meta, cfg)
    out["parent"] = (normal.state_dict(), engine.full_state_dict())

    if world > 1:
        # Every rank draws what rank 0 draws, whatever its own generator was seeded with.
        torch.manual_seed(100 + rank)
        with torch.device("meta"):
            model = MetaTransformer()
        engine = zeroshard.initialize(model, cfg)
        out["seeded_by_rank_0"] = engine.full_state_dict(dtype=torch.float32)

        # An initialisation that differs between ranks is an error on every rank.
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4))

        def by_rank(module):
            for p in module.parameters(recurse=False):
                with torch.no_grad():
                    p.fill_(float(dist.get_rank()))

        try:
            zeroshard.initialize(model, cfg, init_fn=by_rank)
        except RuntimeError as e:
            out["by_rank"] = str(e)

        # One rank's failing init fails every rank, naming it.
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4))

        def fails_on_1(module):
            if dist.get_rank() == 1:
                raise KeyError("no weights for rank 1")
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)

        try:
            zeroshard.initialize(model, cfg, init_fn=fails_on_1)
        except RuntimeError as e:
            out["fails"] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def behaviour_results(world):
    return run_ranks(behaviours, world, timeout=60)


def test_module_without_reset_parameters_is_named():
    message = behaviour_results(1)[0]["raw"]
    assert "'<model>' (Raw)" in message and "init_fn" in message


def test_init_fn_needs_a_meta_model():
    assert "meta device" in behaviour_results(1)[0]["not_meta"]


def test_init_fn_sees_every_module_with_state():
    seen, state = behaviour_results(1)[0]["init_fn"]
    assert sorted(seen) == ["Linear", "Raw"]
    for name, value in state.items():
        assert torch.equal(value, torch.ones_like(value)), name


def test_parent_writing_a_child_parameter_is_kept():
    normal, engine = behaviour_results(1)[0]["parent"]
    for name, value in normal.items():
        assert torch.equal(engine[name], value), name


def test_rank_dependent_init_is_an_error_on_every_rank():
    results = behaviour_results(2)
    for rank in (0, 1):
        assert "step '0' gave rank 1 other values than rank 0" in results[rank]["by_rank"]
        assert "failed on rank 1" in results[rank]["fails"] and "no weights for rank 1" in results[rank]["fails"]


def test_every_rank_draws_from_rank_0s_generator():
    torch.manual_seed(100)
    reference = MetaTransformer().state_dict()
    for rank, result in enumerate(behaviour_results(2)):
        for name, value in reference.items():
            assert torch.equal(result["seeded_by_rank_0"][name], value), (rank, name)
