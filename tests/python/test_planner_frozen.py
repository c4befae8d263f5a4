"""The planner with frozen parameters (planner/frozen.py, planner/freezing.py): a LoRA model
(transformers' LlamaForCausalLM with peft's adapters) and a model that freezes its lower part,
with frozen parameters in two dtypes, cost each rank what the engine's memory_stats() reports,
stages 0-3, fp32 and bf16, at 1 and 2 ranks; a LoRA model planned from a config.json is the
one peft builds; --trainable-fraction trains the last parameters.

The "frozen" keys of memory_stats() (frozen, host_frozen, device_frozen, and the totals that
include them), stage 3's gathers of frozen buffers (gathered_peak, the all-gather traffic) come
with the engine's frozen-parameter sharding (issue 30); the trained keys hold before it.
"""

import pytest
import torch

from models import make_model
from spawn import SharedRuns
from training import engine_config, train_global_batches

from zeroshard.planner import ModelParams, model_state
from zeroshard.planner.freezing import LLAMA_TARGETS, with_lora, with_trainable_fraction
from zeroshard.planner.hf_config import model_params
from zeroshard.planner.setups import ModelSource, Setup, card

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=37,
             intermediate_size=96)
# "lora": the engine's defaults (every parameter of this small model is under the persistence
# threshold: kept whole); "lora_sharded" and "lower_frozen": the frozen matrices sharded at stage
# 3, several buckets, two micro-batches per step. lower_frozen's LayerNorms (40 elements) are
# released too, in fp32 beside the blocks' bf16 Linear layers: two frozen buffers per unit.
# (Its kept trained unit, the head's and the gate's biases, reaches every shard at 2 ranks: a
# rank whose shard of a stage-3 buffer is all padding holds no optimizer state for it, which
# the planner does not count.)
CASES = {
    "lora": ({}, None),
    "lora_sharded": ({"reduce_bucket_size": 300, "stage3_param_persistence_threshold": 100}, 2),
    "lower_frozen": ({"reduce_bucket_size": 700, "stage3_param_persistence_threshold": 38}, 2),
}
# --trainable-fraction that trains exactly the final norm, head and gate of lower_frozen (its first
# parameter, odd, TinyTransformer's own, is frozen with the embedding and the blocks).
FRACTION = 0.098
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
TRAINED_KEYS = ("params", "grads", "optimizer")
FROZEN_KEYS = ("frozen", "total")


def lora_llama(precision):
    """A LoRA model as peft builds it (r=4 on q_proj and v_proj), the base in the run's dtype."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(DTYPES[precision])
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.loss = lambda tokens: model(input_ids=tokens, labels=tokens).loss
    return model


def tiny():
    return make_model(layers=4, dim=40)


def lower_frozen(precision):
    """TinyTransformer with the parameters --trainable-fraction FRACTION freezes frozen: the
    embedding and the blocks, their Linear layers in the run's dtype, their LayerNorms in fp32."""
    model = tiny()
    planned = with_trainable_fraction(ModelParams.of_module(model), FRACTION, precision)
    frozen = {f.name for f in planned.frozen}
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
            if ".norm." not in name:
                p.data = p.data.to(DTYPES[precision])
    return model


def build(case, precision):
    return lower_frozen(precision) if case == "lower_frozen" else lora_llama(precision)


def _config(case, stage, precision, offload=None):
    zero, gas = CASES[case]
    return engine_config(stage, precision=precision, gas=gas, zero={**zero, **(offload or {})})


def _runs(world_size):
    runs = [(case, stage, precision, None) for case in CASES for precision in DTYPES for stage in range(4)]
    if world_size == 2:
        runs += [(case, 3, "bf16", "offload") for case in ("lora_sharded", "lower_frozen")]
    return runs


def _engine_numbers(rank, world_size, runs):
    import zeroshard

    out = {}
    for case, stage, precision, offload in runs:
        model = build(case, precision)
        engine = zeroshard.initialize(model, _config(case, stage, precision, offload and OFFLOAD))
        # The second step is the first that prefetches at stage 3 (the first records the order).
        train_global_batches(model, engine, rank, world_size, range(2))
        out[case, stage, precision, offload] = (engine.memory_stats(), engine.comm_stats()["traffic_bytes"])
    return out


@pytest.fixture(scope="module")
def engine_runs():
    return SharedRuns({ws: {"numbers": (_engine_numbers, _runs(ws))} for ws in (1, 2)}, timeout=120)


def _expected(case, stage, precision, offload, world_size):
    flags = {"offload_optimizer": bool(offload), "offload_params": bool(offload)}
    return model_state(build(case, precision), stage, world_size, precision,
                       _config(case, stage, precision, offload and OFFLOAD), **flags)


def _keys(names, offload):
    return [f"{place}{k}" for k in names for place in ("", "host_", "device_")] if offload else list(names)


def _compare(engine_runs, world_size, names):
    numbers = engine_runs.result(world_size, "numbers")
    for run in _runs(world_size):
        expected = _expected(*run, world_size)
        for rank, by_run in enumerate(numbers):
            mem = by_run[run][0]
            keys = _keys(names, run[3])
            assert {k: mem.get(k) for k in keys} == {k: expected[k] for k in keys}, (run, rank)


@pytest.mark.parametrize("world_size", [1, 2])
def test_trained_states_of_frozen_models_are_the_engines(engine_runs, world_size):
    """Frozen parameters change nothing of the trained ones' bytes: their buckets and units
    are the trained parameters' alone."""
    _compare(engine_runs, world_size, TRAINED_KEYS)


@pytest.mark.parametrize("world_size", [1, 2])
def test_frozen_bytes_are_the_engines_memory_stats(engine_runs, world_size):
    """memory_stats()' frozen (whole below stage 3; at stage 3 a shard of each unit's buffer per
    dtype, padded, and the small ones whole; on the host with offload_param) and its totals."""
    _compare(engine_runs, world_size, FROZEN_KEYS)


def _plan_card(case, stage, precision, world_size):
    model = ModelParams.of_module(build(case, precision))
    return card(Setup(stage), ModelSource("test", model.numel, model), world_size, precision,
                _config(case, stage, precision))


def _transients(engine_runs, world_size, stages):
    numbers = engine_runs.result(world_size, "numbers")
    for case, stage, precision, offload in _runs(world_size):
        if offload or stage not in stages:
            continue
        planned = _plan_card(case, stage, precision, world_size)
        for by_run in numbers:
            mem, traffic = by_run[case, stage, precision, None]
            yield (case, stage, precision), planned, mem, traffic


@pytest.mark.parametrize("world_size", [1, 2])
def test_frozen_models_transients_are_the_engines(engine_runs, world_size):
    """The fp32 gradient copy and the staging of the trained parameters are the engine's; below
    stage 3, where frozen parameters stay whole, so are the traffic and the gathered peak (none)."""
    for where, planned, mem, traffic in _transients(engine_runs, world_size, range(4)):
        assert planned.transient["fp32_grads"] == mem["fp32_grads_peak"], where
        assert mem["staging_peak"] <= planned.transient["staging"], where
        assert (mem["staging_peak"] > 0) == (planned.transient["staging"] > 0), where
        if where[1] < 3:
            assert planned.traffic["intra"] == traffic, where
            assert planned.transient["gathered"] == mem["gathered_peak"] == 0, where


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_gathers_frozen_buffers_with_their_unit(engine_runs, world_size):
    """Stage 3 gathers each unit's frozen buffers for its forward and backward (the root once),
    never reduces them: the step's traffic and the gathered peak include them."""
    for where, planned, mem, traffic in _transients(engine_runs, world_size, (3,)):
        assert planned.traffic["intra"] == traffic, where
        assert planned.transient["gathered"] == mem["gathered_peak"], where


@pytest.mark.parametrize("config", [dict(LLAMA), dict(LLAMA, num_hidden_layers=3, tie_word_embeddings=True,
                                                      attention_bias=True, mlp_bias=True, head_dim=32)])
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), LLAMA_TARGETS])
def test_lora_of_a_config_is_what_peft_builds(config, targets):
    """--model config.json --lora-rank: the parameters (names, sizes, order, trained or frozen
    and their dtype), units and Linear layers of get_peft_model's model, built on the meta device,
    whether LoRA is applied to a config's count or to the module's."""
    hf_config = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16)
    planned = with_lora(ModelParams.of_module(base), 8, targets, "bf16")
    lora = ModelParams.of_module(peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=list(targets))))
    assert with_lora(model_params(hf_config.to_dict())[0], 8, targets, "bf16") == lora
    assert planned == lora
    assert lora.trained_numel == sum(8 * (i + o) for m, i, o in model_params(hf_config.to_dict())[0].linears
                                     if m.rpartition(".")[2] in targets)


def test_trainable_fraction_trains_the_fewest_last_parameters():
    model = ModelParams.of_module(tiny())
    planned = with_trainable_fraction(model, FRACTION, "bf16")
    trained = [n for n, _ in planned.trained]
    assert trained == ["norm.weight", "norm.bias", "head.weight", "head.bias", "gate.weight", "gate.bias"]
    assert planned.trained_numel >= FRACTION * model.numel > planned.trained_numel - dict(model.params)["norm.weight"]
    assert {(f.dtype, f.itemsize) for f in planned.frozen} == {("bf16", 2)}
    assert with_trainable_fraction(model, 1.0, "bf16").frozen == ()
    # The engine's model for the test: the planned parameters frozen, the LayerNorms left in fp32.
    assert ModelParams.of_module(lower_frozen("fp32")) == with_trainable_fraction(model, FRACTION, "fp32")
