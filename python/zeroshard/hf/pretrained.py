"""zeroshard.hf.from_pretrained: a transformers model built on the meta device, whose pretrained
weights the engine reads when the Trainer builds it, each rank only the slices it holds
(Engine.load_pretrained). A 70B checkpoint is then never whole in any process, where
from_pretrained alone loads the whole model into every rank's host memory.

A peft model made from it (get_peft_model, or TRL's peft_config=) works too: the adapters are
initialised as peft initialises them and the base is read under peft's names.
"""

import math
import os

import torch

from zeroshard import meta as _meta

# Set on the model from_pretrained returns: the checkpoint the engine loads.
_SOURCE_ATTR = "_zeroshard_pretrained"


def from_pretrained(model_class, path, *, dtype=None, key_mapping=None, **config_kwargs):
    """model_class (transformers' AutoModelForCausalLM, or a model class) built from the config at
    `path` on the meta device, with no weights read: the zeroshard.hf Trainer's engine allocates
    this rank's share and reads it from `path` (a local folder with model.safetensors or a sharded
    model.safetensors.index.json). dtype: the parameters' dtype (torch.bfloat16 for a bf16
    checkpoint; default the config's). key_mapping: as Engine.load_pretrained's.
    config_kwargs: passed to AutoConfig.from_pretrained (e.g. trust_remote_code)."""
    from transformers import AutoConfig

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zeroshard.hf.from_pretrained: {path!r} is not a local folder; download the model "
                                "first (e.g. `hf download <repo> --local-dir <folder>`) and pass the folder")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, **kwargs)
        else:
            model = model_class._from_config(config, **kwargs)
    setattr(model, _SOURCE_ATTR, (path, key_mapping))
    return model


class PendingLoad:
    """What the Trainer does for a from_pretrained model when it builds the engine: init_fn for
    the parameters the checkpoint does not hold (peft's adapters), load() for the rest."""

    def __init__(self, model, path, key_mapping):
        self._model = model
        self._path = path
        self._key_mapping = key_mapping
        self._adapters = _lora_adapters(model)
        self._base_init = _meta.default_init_fn(model)
        # Trained parameters are initialised here, not read: those of peft's LoRA A and B linears
        # can be; any other (DoRA's magnitude, an embedding LoRA, modules_to_save's copy) starts
        # from the base weights, which the meta model does not have yet.
        covered = {id(p) for m in model.modules() if id(m) in self._adapters for p in m.parameters()}
        others = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
        if _is_peft(model) and others:
            raise ValueError("zeroshard.hf.from_pretrained: these trained parameters of the peft model start from "
                             f"the base weights, which a model on the meta device does not have: "
                             f"{', '.join(others[:5])}{' ...' if len(others) > 5 else ''}; use a LoRA without DoRA, "
                             "embedding targets or modules_to_save, or build the model with transformers' "
                             "from_pretrained")

    def init_fn(self, module):
        adapter = self._adapters.get(id(module))
        if adapter is not None:
            _init_lora(module, *adapter)
        elif self._base_init is not None:
            self._base_init(module)
        else:
            module.reset_parameters()

    def load(self, engine):
        """Reads the checkpoint into the engine: every tensor the model has must be in it, except
        the adapters (which keep their initial values)."""
        loaded = engine.load_pretrained(self._path, strict=False, key_mapping=self._key_mapping)
        adapter_names = {n for n, p in self._model.named_parameters() if _is_adapter_name(n)}
        missing = [k for k in loaded.missing_keys if k not in adapter_names]
        problems = []
        if missing:
            problems.append(f"missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if loaded.unexpected_keys:
            problems.append(f"unexpected: {', '.join(loaded.unexpected_keys[:10])}")
        if loaded.mismatched_keys:
            problems.append(f"wrong shape: {', '.join(str(k) for k in loaded.mismatched_keys[:10])}")
        if problems:
            raise RuntimeError(f"zeroshard.hf.from_pretrained: the checkpoint {self._path} does not match the model "
                               f"({'; '.join(problems)}); pass key_mapping= to rename the checkpoint's tensors")
        return loaded


def pending_load(model):
    """The PendingLoad of a model from from_pretrained (or a peft model made from one), else None."""
    for module in model.modules():
        source = getattr(module, _SOURCE_ATTR, None)
        if source is not None:
            if not _meta.on_meta(model):
                return None  # materialised since (e.g. to_empty + its own load): nothing to read
            return PendingLoad(model, *source)
    return None


def _is_peft(model):
    return getattr(model, "peft_config", None) is not None and hasattr(model, "get_base_model")


def _is_adapter_name(name):
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name or ".lora_magnitude" in name


def _lora_adapters(model):
    """{id(module): (kind, rank, init)} for peft LoRA's A and B linears."""
    found = {}
    for module in model.modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not isinstance(lora_b, torch.nn.ModuleDict):
            continue
        for adapter, a in lora_a.items():
            config = module.r.get(adapter) if isinstance(getattr(module, "r", None), dict) else None
            init = _peft_init(model, adapter)
            found[id(a)] = ("A", config, init)
            found[id(lora_b[adapter])] = ("B", config, init)
    return found


def _peft_init(model, adapter):
    configs = getattr(model, "peft_config", None) or {}
    config = configs.get(adapter)
    return True if config is None else config.init_lora_weights


def _init_lora(module, kind, rank, init):
    # peft's LoraLayer.reset_lora_parameters for the initialisations that need no base weight.
    if init is True:
        if kind == "A":
            torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            torch.nn.init.zeros_(module.weight)
    elif init == "gaussian":
        if kind == "A":
            torch.nn.init.normal_(module.weight, std=1 / rank)
        else:
            torch.nn.init.zeros_(module.weight)
    else:
        raise ValueError(f"zeroshard.hf.from_pretrained: peft's init_lora_weights={init!r} needs the base weights "
                         "when the adapters are made, which a model on the meta device does not have; use True "
                         "(peft's default) or \"gaussian\", or build the model with transformers' from_pretrained")
    if getattr(module, "bias", None) is not None:
        torch.nn.init.zeros_(module.bias)
