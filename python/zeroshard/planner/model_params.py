"""A model's parameters as the planner counts them: names, sizes, which are trained and which
frozen (and in which dtype), the stage-3 unit of each, and the Linear layers LoRA can target.
Built from a module (ModelParams.of_module) or from a Hugging Face config (planner.hf_config),
and changed by planner.freezing (LoRA, a trained fraction)."""

from dataclasses import dataclass
from typing import NamedTuple

ROOT = "<root>"

# The planner's names for the dtypes of its --dtype flag; other dtypes by torch's name.
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


class FrozenParam(NamedTuple):
    """A parameter with requires_grad=False, held in its own dtype ("bf16", "fp32", ...)."""

    name: str
    dtype: str
    itemsize: int


class Linear(NamedTuple):
    """A Linear layer (or GPT-2's Conv1D): the module's name, in_features, out_features."""

    module: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelParams:
    """params: every parameter, (name, numel), in named_parameters() order, a tied one once.
    units: the stage-3 unit specs, (unit name, names of its parameters, trained and frozen), the
    root "<root>" last, by the rule of stage3/unit_builder.cpp assignUnits. frozen: the
    FrozenParam of each parameter that is not trained, in the same order. linears: the Linear
    layers, in named_modules() order."""

    params: tuple
    units: tuple
    frozen: tuple = ()
    linears: tuple = ()

    @classmethod
    def of_module(cls, model, unit_classes=()):
        """The module's own parameters and units, found as zeroshard.initialize finds them
        (zeroshard.stage3_unit_classes, else the children of the largest nn.ModuleList)."""
        params = tuple((n, p.numel()) for n, p in model.named_parameters())
        frozen = tuple(FrozenParam(n, _dtype_name(p.dtype), p.element_size())
                       for n, p in model.named_parameters() if not p.requires_grad)
        linears = tuple(Linear(n, *_features(m)) for n, m in model.named_modules() if _features(m) is not None)
        return cls(params, _units(model, unit_classes), frozen, linears)

    @property
    def trained(self):
        """(name, numel) of the trained parameters, in order."""
        frozen = {f.name for f in self.frozen}
        return tuple((n, k) for n, k in self.params if n not in frozen)

    @property
    def numel(self):
        return sum(n for _, n in self.params)

    @property
    def trained_numel(self):
        return sum(n for _, n in self.trained)

    @property
    def frozen_numel(self):
        return self.numel - self.trained_numel


def _dtype_name(dtype):
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def _features(module):
    """(in_features, out_features) of a Linear, or of a Conv1D (transformers' GPT-2 layer,
    weight in x out, which peft's LoRA also targets); None for any other module."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return tuple(module.weight.shape)
    return None


def _units(model, unit_classes):
    """(unit name, parameter names) of every unit and the root, frozen parameters included.

    The rule lives once, in C++ (assignUnits, bound as _C._assign_units), which takes trained
    parameters only: each parameter stands in as an empty proxy that requires grad, the same
    proxy wherever the parameter is, so the rule sees the model's sharing as it is."""
    import torch

    from zeroshard import _C, stage3

    proxies = {}

    def proxy(p):
        return proxies.setdefault(id(p), torch.empty(0, requires_grad=True))

    found = stage3.find_units(model, unit_classes)
    specs = _C._assign_units([(n, proxy(p)) for n, p in model.named_parameters()], [n for n, _ in found],
                             [[proxy(p) for p in m.parameters()] for _, m in found])
    return tuple((s["name"], tuple(s["params"])) for s in specs)
