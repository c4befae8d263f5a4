"""Compiled units: each unit's forward compiled in place with torch.compile, zeroshard's hooks
outside the graphs (Engine.compile, docs/compile.md).

Note [hooks outside the graphs]: a unit is compiled by replacing its `forward` with the
torch.compile of it, on the instance, rather than by nn.Module.compile(), which compiles
_call_impl and so traces the forward hooks too. zeroshard's module hooks (stage 3's gather
before a unit's forward, its release after, the registration of its backward hooks on the
outputs; the bf16/fp16 input cast on the model) call into C++ and must run as they do eagerly,
at their place between units: they stay in the module's eager _call_impl around the compiled
forward, and the gradient hooks (the reductions, stage 3's gathers before a unit's backward)
are autograd hooks on parameters and outputs, which fire around the compiled backward as
around an eager one. The units are those stage 3 gathers one by one (found by the same rule
below stage 3: zeroshard.stage3_unit_classes, or the children of the largest nn.ModuleList);
a model with none is compiled whole. Every unit of one class shares one compiled graph:
dynamo's guards treat the parameters as inputs, so the units' different parameters (and stage
3's gathered storage) do not recompile.
"""

import types

import torch

from zeroshard import stage3


def is_compiled(module):
    """Whether compile_units compiled `module`'s forward: the mark is on the compiled function,
    so a model loaded from torch.save (whose units run the class's forward again) is not."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "__func__", forward), "_zeroshard_compiled", False)


def compile_units(model, units, backend="inductor", **compile_kwargs):
    """Compiles the forward of each of `units` ([(name, module)]; the model itself when empty) in
    place. Returns the names compiled ("" for the model). A unit compiled before is an error: a
    second compile would compile the compiled function."""
    targets = units or [("", model)]
    for name, module in targets:
        if is_compiled(module):
            raise RuntimeError(f"zeroshard: engine.compile(): unit '{name or '<model>'}' is compiled already; "
                               "compile once, after initialize (which compiles when the config's "
                               "compile.enabled is true)")
    for name, module in targets:
        # Note [hooks outside the graphs]: the instance's forward, not nn.Module.compile(). The
        # class's forward compiled and bound to the instance, not the bound method compiled:
        # copy.deepcopy rebinds a bound method to the copy (an EMA or teacher copy computes with
        # its own parameters), where a closure over the original's method would not. A forward
        # bound to the instance (what torch.load leaves) is its function, bound again.
        own = module.__dict__.get("forward")  # a forward set on the instance (a wrapper's patch)
        if own is None or (isinstance(own, types.MethodType) and own.__self__ is module):
            function = type(module).forward if own is None else own.__func__
            compiled = torch.compile(function, backend=backend, **compile_kwargs)
            compiled._zeroshard_compiled = True
            module.forward = types.MethodType(compiled, module)
        else:
            compiled = torch.compile(own, backend=backend, **compile_kwargs)
            compiled._zeroshard_compiled = True
            module.forward = compiled
    return [name for name, _ in targets]


def units_of(engine_units, model, class_names):
    """The units to compile: stage 3's own, else the same rule's (stage3.find_units)."""
    if engine_units is not None:
        return engine_units
    return stage3.find_units(model, class_names)
