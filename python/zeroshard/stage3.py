"""Stage 3 module hooks: which modules are units, and the hooks that call the C++ engine.

A unit's parameters are gathered before its forward and released after it (and again around
its backward, from C++ autograd hooks). Python only finds the units and forwards the module
hooks; the gathering, prefetching and releasing happen in C++ (csrc/zeroshard/stage3/unit_scheduler.*).
"""

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from zeroshard import _C


def find_units(model, class_names=()):
    """(name, module) of every unit: the outermost submodules whose class name is in
    class_names, or by default the children of the model's largest nn.ModuleList."""
    if class_names:
        wanted, units, taken = set(class_names), [], []
        for name, module in model.named_modules():
            if module is model or type(module).__name__ not in wanted:
                continue
            if any(name.startswith(t + ".") for t in taken):
                continue  # inside a unit already
            units.append((name, module))
            taken.append(name)
        if not units:
            raise ValueError(f"zeroshard stage 3: no module of class {sorted(wanted)} in the model "
                             f"(zeroshard.stage3_unit_classes)")
        return units
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    name, largest = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(largest)]


def unit_specs(model, units):
    """One spec per unit plus the root (the rule is in C++, stage3/unit_builder.h: a parameter of
    exactly one unit belongs to it; the rest, e.g. tied weights shared by units, to the root)."""
    return _C._assign_units(list(model.named_parameters()), [name for name, _ in units],
                            [list(module.parameters()) for _, module in units])


def _tensors(output):
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]


def _pre_forward(core, index, watches):
    """The pre-hook of unit `index`. A unit that watches its inputs (it holds frozen parameters)
    gets a view of each input that requires grad: the gradient hook on the view fires once this
    unit's backward has computed its part of the input's gradient, so the unit is released
    before the backward of the unit before it starts and prefetches (a hook on the input itself
    would fire after that one, which is registered first; FSDP2 puts an autograd function there)."""

    def hook(_module, args, kwargs):
        if not watches:
            core.pre_forward(index)
            return None
        if torch.is_grad_enabled():
            def view(t):
                return t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
            args, kwargs = tree_map(view, args), tree_map(view, kwargs)
        core.pre_forward(index, _tensors((args, kwargs)))
        return args, kwargs

    return hook


def install_hooks(core, model, units):
    """Forward pre/post hooks on each unit and on the model (the root unit, index len(units)).
    The pre-hook of a unit holding frozen parameters passes its inputs: it is released in
    backward once their gradients are computed (stage3/unit_scheduler.cpp, Note [release after
    backward])."""
    handles = []
    for index, module in enumerate([m for _, m in units] + [model]):
        handles.append(module.register_forward_pre_hook(_pre_forward(core, index, core.watches_inputs(index)),
                                                        with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda _module, _args, output, index=index: core.post_forward(index, _tensors(output))))
    return handles
