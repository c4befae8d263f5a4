"""Hugging Face models (transformers, an optional test dependency: skipped without it).

Held to: the stage-3 units of the common layouts are found without configuration (Llama's
model.layers, GPT-2's transformer.h, GPT-NeoX's gpt_neox.layers) on a model built on the meta
device and initialised through its _init_weights; examples/finetune_hf.py under torchrun on 2
ranks (meta build, load_pretrained from a sharded safetensors checkpoint, ZeRO-3 fine-tuning,
save_16bit_model) gives logits equal to from_pretrained's, before and after training, for Llama
and for GPT-NeoX (whose checkpoint names its head embed_out.weight, transformers' renaming).
"""

import functools
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import zeroshard  # noqa: E402
from spawn import run_ranks  # noqa: E402

HERE = os.path.dirname(__file__)
EXAMPLE = os.path.join(HERE, os.pardir, os.pardir, "examples", "finetune_hf.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
from finetune_hf import ARCHS  # noqa: E402

LAYERS = {"llama": "model.layers", "gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}


def units_of_each_arch(rank, world):
    out = {}
    for arch, (name, kwargs) in ARCHS.items():
        config = getattr(transformers, name)(**kwargs)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        engine = zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1,
                                              "zero_optimization": {"stage": 3}})
        tokens = torch.randint(0, config.vocab_size, (1, 8))
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        out[arch] = {"units": [u["name"] for u in engine.stage3_units()], "loss": loss.item(), "buffers": buffers,
                     "layers": config.num_hidden_layers if hasattr(config, "num_hidden_layers") else config.n_layer}
    return out


@functools.lru_cache(maxsize=None)
def arch_results():
    return run_ranks(units_of_each_arch, 1, timeout=120)[0]


@pytest.mark.parametrize("arch", sorted(LAYERS))
def test_units_of_common_layouts_are_found(arch):
    result = arch_results()[arch]
    assert result["units"] == [f"{LAYERS[arch]}.{i}" for i in range(result["layers"])] + ["<root>"]
    assert torch.isfinite(torch.tensor(result["loss"]))


def test_meta_init_recomputes_rotary_buffers():
    # _init_weights (the default init_fn for a Hugging Face model) sets inv_freq, which a meta
    # build leaves without values: 1 / theta^(2i / head_dim).
    buffers = arch_results()["llama"]["buffers"]
    head_dim = ARCHS["llama"][1]["hidden_size"] // ARCHS["llama"][1]["num_attention_heads"]
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(buffers["model.rotary_emb.inv_freq"], expected)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_finetune_example_loads_trains_and_saves_for_from_pretrained(tmp_path, arch):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), EXAMPLE, "--work", str(tmp_path), "--steps", "3", "--arch", arch]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["loaded_equal"], done.stdout
    assert result["reloaded_equal"], result["max_diff"]
    assert result["units"][0] == f"{LAYERS[arch]}.0"
    # The pretrained checkpoint was sharded, so loading went through the index.
    index = json.loads((tmp_path / "pretrained" / "model.safetensors.index.json").read_text())
    if arch == "gpt_neox":
        # save_pretrained stores the head as embed_out.weight; transformers' conversion mapping
        # renames it to the model's lm_head.weight, and load_pretrained applies that mapping.
        assert "embed_out.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
