"""LoRA with a real peft model (issue 30, "LoRA on large models: frozen weights sharded at ZeRO-3").

A peft LoRA (q_proj, v_proj) on a tiny transformers Llama, its base in fp32 or bf16, trained at
1, 2 and 4 ranks (Gloo) at stages 1, 2 and 3 with fp32 adapters (lora_runs.py). Held to:
(a) the adapters match single-process torch.optim.AdamW over the same global batches; (b) the
frozen base is bitwise unchanged; (c) peft's merge_and_unload on the trained adapters gives the
engine model's logits; (d) save_16bit_model(exclude_frozen_parameters=True) writes an adapter
that peft loads (PeftModel.from_pretrained, set_peft_model_state_dict); (e) memory_stats()
counts the frozen base per rank: whole at stages 1-2, each unit's padded shard per dtype at
stage 3; (f) a checkpoint saved without the frozen base loads at another world size and stage
over the base the loading run holds. Quantized bases: stage 3 refuses them, stage 2 trains
with them whole.

One spawned run per world size holds every case of that world size (spawn.SharedRuns).
"""

import os

import pytest
import torch

peft = pytest.importorskip("peft")

from conftest import WORLD_SIZES  # noqa: E402
from lora_runs import (CHECKPOINT_LOAD, CHECKPOINT_SAVE, STEPS, THRESHOLD, adamw_reference,  # noqa: E402
                       base_model, deepspeed_exports, load_over_another_base, lora_model, probe,
                       quantized_at_stage2, quantized_at_stage3, save_without_frozen, split_state,
                       train_and_export)
from model_state import padded_numel  # noqa: E402
from spawn import SharedRuns  # noqa: E402

STAGES = (1, 2, 3)
BASES = ("fp32", "bf16")
PACKED = "base_model.model.model.layers.0.mlp.packed"


class _Runs(SharedRuns):
    def result(self, world_size, name):
        if world_size == CHECKPOINT_LOAD["world_size"]:
            # Its run loads what CHECKPOINT_SAVE's run saved: that one is spawned first.
            try:
                super().result(CHECKPOINT_SAVE["world_size"], "checkpoint_save")
            except AssertionError:
                pass  # checkpoint_load says what it misses
        return super().result(world_size, name)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def runs(exports):
    cases = {ws: {f"stage{stage}_{base}": (train_and_export, str(exports / f"ws{ws}_stage{stage}_{base}"), stage, base)
                  for stage in STAGES for base in BASES} for ws in WORLD_SIZES}
    cases[1]["quantized_stage3"] = (quantized_at_stage3,)
    cases[1]["deepspeed"] = (deepspeed_exports, str(exports / "deepspeed"))
    cases[2]["quantized_stage2"] = (quantized_at_stage2,)
    # Last in their runs, as a failing case stops the ones after it; the load reads what the save wrote.
    cases[CHECKPOINT_SAVE["world_size"]]["checkpoint_save"] = (save_without_frozen, str(exports / "ckpt"))
    cases[CHECKPOINT_LOAD["world_size"]]["checkpoint_load"] = (load_over_another_base, str(exports / "ckpt"))
    return _Runs(cases)


@pytest.fixture(scope="module")
def reference():
    """{base: (the adapters after each step, the model)} of single-process AdamW."""
    return {base: adamw_reference(base, range(STEPS)) for base in BASES}


def _trained(runs, world_size, stage, base):
    return runs.result(world_size, f"stage{stage}_{base}")


cases = pytest.mark.parametrize("world_size, stage, base",
                                [(ws, stage, base) for ws in WORLD_SIZES for stage in STAGES for base in BASES])


@cases
def test_adapters_match_single_process_adamw(runs, reference, world_size, stage, base):
    expected = reference[base][0][-1]
    for rank, result in enumerate(_trained(runs, world_size, stage, base)):
        assert set(result["adapters"]) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(result["adapters"][name], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


@cases
def test_frozen_base_is_bitwise_unchanged(runs, world_size, stage, base):
    model = lora_model(base)
    _, initial = split_state(model, model.state_dict())
    for rank, result in enumerate(_trained(runs, world_size, stage, base)):
        assert set(result["frozen"]) == set(initial)
        for name, value in initial.items():
            assert result["frozen"][name].dtype == value.dtype, (rank, name)
            assert torch.equal(result["frozen"][name], value), (rank, name)


def _with_adapters(base, adapters):
    model = lora_model(base)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert unexpected == [] and not set(adapters) & set(missing)
    return model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=probe()).logits.float()


# bf16 base: merging adds the adapters' product to the bf16 weights in bf16, one rounding of the
# weights away from the unmerged model; fp32: rounding only.
LOGITS_TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=0.0, atol=1e-2)}


@cases
def test_merged_model_gives_the_engine_logits(runs, world_size, stage, base):
    results = _trained(runs, world_size, stage, base)
    merged = _with_adapters(base, results[0]["adapters"]).merge_and_unload()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    for rank, result in enumerate(results):
        torch.testing.assert_close(_logits(merged), result["logits"], **LOGITS_TOLERANCE[base],
                                   msg=lambda m: f"rank {rank}: {m}")


@cases
def test_adapter_file_holds_peft_keys_and_the_trained_values(runs, exports, world_size, stage, base):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    results = _trained(runs, world_size, stage, base)
    assert [r["saved"] for r in results] == [True] * world_size
    out = exports / f"ws{world_size}_stage{stage}_{base}"
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]  # nothing partial
    file = load_file(out / "adapter_model.safetensors")
    model = _with_adapters(base, results[0]["adapters"])
    expected = get_peft_model_state_dict(model)  # the names peft saves: no adapter name, prefix kept
    assert sorted(file) == sorted(expected) and all(k.startswith("base_model.model.") for k in file)
    for name, value in expected.items():
        assert file[name].dtype == torch.float32 and torch.equal(file[name], value), name


@cases
def test_adapter_file_loads_into_peft_with_the_engine_logits(runs, exports, world_size, stage, base):
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    results = _trained(runs, world_size, stage, base)
    out = exports / f"ws{world_size}_stage{stage}_{base}"
    expected = _logits(_with_adapters(base, results[0]["adapters"]))
    loaded = PeftModel.from_pretrained(base_model(base), out)
    assert torch.equal(_logits(loaded), expected)
    fresh = lora_model(base)
    set_peft_model_state_dict(fresh, load_file(out / "adapter_model.safetensors"))
    assert torch.equal(_logits(fresh), expected)
    torch.testing.assert_close(_logits(loaded), results[0]["logits"], rtol=1e-5, atol=1e-6 if base == "fp32" else 1e-3)


def _frozen_bytes(world_size, stage, base, units):
    """Bytes of the frozen base one rank holds: whole below stage 3; at stage 3, per unit and
    dtype, the flat buffer of the unit's frozen parameters of more than
    stage3_param_persistence_threshold elements, padded as FlatLayout pads (padded_numel),
    divided by the world size, plus the persistent ones whole (stage3/unit_builder.h,
    frozenBuckets and frozenWhole)."""
    frozen = [(n, p) for n, p in lora_model(base).named_parameters() if not p.requires_grad]
    if stage < 3:
        return sum(p.numel() * p.element_size() for _, p in frozen)
    total, flat = 0, {}
    blocks = [u for u in units if u != "<root>"]
    for name, p in frozen:
        if p.numel() <= THRESHOLD:
            total += p.numel() * p.element_size()
            continue
        unit = next((u for u in blocks if name.startswith(u + ".")), "<root>")
        key = (unit, p.element_size())
        flat[key] = flat.get(key, 0) + p.numel()
    return total + sum(padded_numel(n, world_size) // world_size * size for (_, size), n in flat.items())


@cases
def test_frozen_bytes_per_rank_follow_the_formula(runs, world_size, stage, base):
    for rank, result in enumerate(_trained(runs, world_size, stage, base)):
        memory = result["memory"]
        assert memory["frozen"] == _frozen_bytes(world_size, stage, base, result["units"]), (rank, memory)
        assert memory["device_frozen"] == memory["frozen"] and memory["host_frozen"] == 0, (rank, memory)


def test_checkpoint_without_frozen_loads_at_another_world_size_and_stage(runs, exports):
    saved = runs.result(CHECKPOINT_SAVE["world_size"], "checkpoint_save")[0]
    loaded = runs.result(CHECKPOINT_LOAD["world_size"], "checkpoint_load")
    base = CHECKPOINT_SAVE["base"]
    model = lora_model(base, CHECKPOINT_LOAD["seed"])
    _, own_base = split_state(model, model.state_dict())
    # Note [the frozen base across a checkpoint]: AdamW's steps, the base swapped after the save.
    expected = adamw_reference(base, range(CHECKPOINT_SAVE["steps"] + 1),
                               base_seed_from=(CHECKPOINT_SAVE["steps"], CHECKPOINT_LOAD["seed"]))[0][-1]
    for rank, result in enumerate(loaded):
        for name, value in saved.items():
            assert torch.equal(result["loaded"][name], value), (rank, name)
        for name, value in own_base.items():
            assert torch.equal(result["frozen"][name], value), (rank, name)
        for name, value in expected.items():
            torch.testing.assert_close(result["continued"][name], value, rtol=1e-4, atol=1e-6)
    # Nothing of the base is in it: its files are smaller than the base alone.
    frozen_bytes = sum(v.numel() * v.element_size() for v in own_base.values())
    files = [f for f in (exports / "ckpt" / "adapters").iterdir()]
    assert sum(f.stat().st_size for f in files) < frozen_bytes, sorted(f.name for f in files)


def test_stage3_refuses_a_quantized_frozen_weight(runs):
    errors = runs.result(1, "quantized_stage3")[0]
    for kind, cls in (("Params4bit", "Params4bit"), ("uint8", "Parameter")):
        message = errors[kind]
        assert message is not None, f"stage 3 accepted a frozen {kind} weight"
        for part in (f"'{PACKED}'", f"({cls}, dtype torch.uint8", "stage 2", "bf16"):
            assert part in message, (part, message)


def test_stage2_trains_with_a_quantized_frozen_weight_whole(runs, reference):
    expected = reference["fp32"][0][1]
    for rank, result in enumerate(runs.result(2, "quantized_stage2")):
        assert result["class"] == "Params4bit"
        assert torch.equal(result["packed"], torch.arange(64, dtype=torch.uint8).reshape(8, 8)), rank
        for name, value in expected.items():
            torch.testing.assert_close(result["adapters"][name], value, rtol=1e-4, atol=1e-6)


def test_deepspeed_layer_exports_the_adapter(runs, exports):
    from safetensors.torch import load_file

    assert runs.result(1, "deepspeed")[0] == (True, True)
    adapter, whole = exports / "deepspeed" / "adapter", exports / "deepspeed" / "model"
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(".default." not in k for k in load_file(adapter / "adapter_model.safetensors"))
    # Without exclude_frozen_parameters: DeepSpeed's file, the module's own names, base included.
    assert os.listdir(whole) == ["pytorch_model.bin"]
    state = torch.load(whole / "pytorch_model.bin", weights_only=True)
    assert state.keys() == lora_model("fp32").state_dict().keys()
