"""Frozen parameters (a LoRA base) in what an engine saves and loads: checkpoints with and
without the sharded base, save_16bit_model and load_pretrained of it, meta-device init, and a
zeroshard.deepspeed GatheredParameters write-back (test_frozen.py trains them)."""

import torch

from frozen_runs import STEPS, config as _config, frozen_state as _frozen_state
from model_state import padded_numel
from spawn import SharedRuns
from training import LR, train_global_batches


def _shared_dir(name):
    """A directory every rank of this spawn names alike (they share the parent process)."""
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"zeroshard-frozen-{os.getppid()}", name)
    os.makedirs(path, exist_ok=True)
    return path


def _checkpoint_case(rank, world_size):
    """Stage 3 saves its sharded frozen base (gathered unit by unit) or leaves it out
    (exclude_frozen_parameters); loads at stages 2 and 3 restore what was saved and keep the
    rest."""
    import json
    import os

    import zeroshard
    from models import make_lora_model

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    engine = zeroshard.initialize(model, _config(3))
    train_global_batches(model, engine, rank, world_size, STEPS)
    full = engine.save_checkpoint(_shared_dir("ckpt"), tag="full")
    adapters = engine.save_checkpoint(_shared_dir("ckpt"), tag="adapters", exclude_frozen_parameters=True)
    saved = engine.full_state_dict(dtype=torch.float32)
    def manifest(path):
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)["manifest"]

    frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}
    out = {"excluded_keys": [k for k in manifest(adapters)["state_dict_keys"] if k in frozen_names],
           "excluded_flag": manifest(adapters).get("frozen_excluded"),
           "full_flag": "frozen_excluded" in manifest(full),
           "no_frozen_file": not os.path.exists(os.path.join(adapters, "module_state.safetensors"))}
    for stage, tag in ((2, "full"), (3, "adapters")):
        other = make_lora_model(seed=5, base_dtype=torch.bfloat16)  # another base
        other_base = _frozen_state(other)
        loader = zeroshard.initialize(other, _config(stage))
        loader.load_checkpoint(_shared_dir("ckpt"), tag=tag)
        loaded = loader.full_state_dict(dtype=torch.float32)
        out[tag] = {"adapters": all(torch.equal(loaded[k], saved[k]) for k in saved if "lora_" in k),
                    "base": all(torch.equal(loaded[k], (saved[k] if tag == "full" else other_base[k].float())
                                            if loaded[k].dtype == torch.float32 else
                                            (saved[k] if tag == "full" else other_base[k]))
                                for k in other_base)}
    return out


def _export_and_load_case(rank, world_size):
    """save_16bit_model at stage 3 writes the frozen base gathered unit by unit; load_pretrained
    reads it back into another engine's frozen shards, each rank only its slices."""
    from safetensors.torch import load_file

    import zeroshard
    from models import make_lora_model

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    engine = zeroshard.initialize(model, _config(3, zero={"stage3_gather_16bit_weights_on_model_save": True}))
    engine.save_16bit_model(_shared_dir("export"), "model.safetensors")
    # Without the frozen parameters (an adapter export) each unit's trained bucket is gathered alone.
    from zeroshard import _C

    frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
    adapter_stats = _C._save_16bit_model(engine._core, _shared_dir("export"), "adapters.safetensors", frozen_names)
    with engine.gathered_parameters():
        base = _frozen_state(model)
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    written_adapters = load_file(f"{_shared_dir('export')}/adapters.safetensors")
    written = load_file(f"{_shared_dir('export')}/model.safetensors")
    other = make_lora_model(seed=9, base_dtype=torch.bfloat16)
    loader = zeroshard.initialize(other, _config(3))
    loader.load_pretrained(_shared_dir("export"))
    with loader.gathered_parameters():
        loaded = _frozen_state(other)
    trained_units = [padded_numel(u["numel"], world_size) * 4 for u in engine.stage3_units()]
    return {"written": all(torch.equal(written[k], v) for k, v in base.items()),
            "adapters": sorted(written_adapters) == sorted(adapters) and
            all(torch.equal(written_adapters[k], v) for k, v in adapters.items()),
            "adapter_peak": (adapter_stats["gathered_peak"], max(trained_units)),
            "loaded": all(torch.equal(loaded[k], v) for k, v in base.items()),
            "frozen_read": loader.last_load_stats()["module_state_bytes_read"],
            "frozen_held": loader.memory_stats()["frozen"], "units": loader.stage3_units(),
            "sizes": {n: p.numel() for n, p in other.named_parameters()}}


def _meta_case(rank, world_size):
    """A model built on the meta device: stage 3 allocates only this rank's frozen shards and
    initialises them to the values stage 1 gives them whole."""
    import zeroshard
    from models import LoraTransformer

    values = {}
    for stage in (1, 3):
        torch.manual_seed(3)
        with torch.device("meta"):
            model = LoraTransformer(base_dtype=torch.bfloat16)
        engine = zeroshard.initialize(model, _config(stage))
        with engine.gathered_parameters():
            values[stage] = _frozen_state(model)
        values[f"bytes{stage}"] = engine.memory_stats()["frozen"]
    return {"equal": all(torch.equal(values[3][k], v) for k, v in values[1].items()),
            "nonzero": any(v.abs().sum() > 0 for v in values[3].values()),
            "bytes": (values["bytes1"], values["bytes3"])}


def _gathered_write_case(rank, world_size):
    """zeroshard.deepspeed's GatheredParameters(modifier_rank=0): rank 0's change to a frozen
    weight reaches every rank's slice of it at stage 3 and stays after the gathered copy goes."""
    import zeroshard.deepspeed as deepspeed
    from models import make_lora_model

    model = make_lora_model(seed=0, base_dtype=torch.bfloat16)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    weight = model.blocks[0].up.base.weight
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            weight.fill_(0.5 if rank == 0 else -1.0)
    with deepspeed.zero.GatheredParameters([weight]):
        return weight.detach().clone()


RUNS = SharedRuns({2: {"gathered_write": (_gathered_write_case,), "checkpoint": (_checkpoint_case,),
                       "export": (_export_and_load_case,), "meta": (_meta_case,)}})


def test_checkpoints_save_the_sharded_base_or_exclude_it():
    for r in RUNS.result(2, "checkpoint"):
        assert r["full"] == {"adapters": True, "base": True}, "a full checkpoint restores adapters and base"
        assert r["adapters"] == {"adapters": True, "base": True}, "an adapters-only one keeps the loading base"
        assert r["excluded_flag"] is True and r["full_flag"] is False
        assert r["excluded_keys"] == [], "exclude_frozen_parameters left frozen names in the manifest"
        assert r["no_frozen_file"], "the model has no buffers: nothing but frozen parameters was module state"


def test_save_16bit_model_and_load_pretrained_carry_the_sharded_base():
    results = RUNS.result(2, "export")
    for r in results:
        assert r["written"] and r["loaded"] and r["adapters"]
        peak, largest_trained_bucket = r["adapter_peak"]
        assert peak == largest_trained_bucket, "an adapter export gathered frozen buffers too"
    # Each rank read exactly the frozen slices it keeps (bf16: 2 bytes), and whole the ones at or
    # under the threshold, which are no unit's.
    for rank, r in enumerate(results):
        in_units = {n for u in r["units"] for n in u["frozen"]}
        whole = sum(2 * n for name, n in r["sizes"].items() if "lora_" not in name and name not in in_units)
        held = 0
        for u in r["units"]:
            numel = sum(r["sizes"][n] for n in u["frozen"])
            shard = padded_numel(numel, 2) // 2
            held += max(0, min(numel, (rank + 1) * shard) - rank * shard)
        assert r["frozen_read"] == 2 * held + whole, rank
    assert results[0]["frozen_read"] + results[1]["frozen_read"] < 2 * sum(
        2 * n for name, n in results[0]["sizes"].items() if "lora_" not in name)


def test_a_deepspeed_gathered_write_to_a_frozen_weight_is_kept():
    for value in RUNS.result(2, "gathered_write"):
        assert torch.equal(value, torch.full_like(value, 0.5))


def test_meta_init_shards_the_frozen_base_with_the_values_stage_1_gives():
    for r in RUNS.result(2, "meta"):
        assert r["equal"] and r["nonzero"]
        whole, sharded = r["bytes"]
        assert sharded < whole
