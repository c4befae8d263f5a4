"""Models built on the meta device: the steps that initialise them (zeroshard.initialize).

The engine allocates only what this rank keeps and runs the steps (csrc/zeroshard/state/meta_init.cpp,
Note [meta initialisation]): one per module that holds parameters or buffers of its own, in
named_modules() order, each calling the module's reset_parameters() or init_fn(module).
"""

import functools

import torch
import torch.distributed as dist

from zeroshard import _C


def on_meta(model):
    return any(t.is_meta for t in _tensors(model))


def _tensors(model):
    yield from model.parameters()
    yield from model.buffers()


def engine_device(process_group):
    """Where a meta model's shards go: this rank's GPU when the group runs NCCL, else the CPU."""
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(process_group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_init_fn(model):
    """A Hugging Face model initialises through its _init_weights(module) (what its post_init
    applies to every module, rotary buffers included); other models through reset_parameters."""
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights) and hasattr(model, "config"):
        return init_weights
    return None


def init_steps(model, groups, device, init_fn=None, frozen=None):
    """(module name, its parameters' engine names, callable) per module holding state.

    Buffers and frozen parameters on the meta device first get zeroed storage on `device` (in
    place: the module keeps its tensors); the steps then fill them with the module's trained
    parameters. `frozen` (stage 3: [(name, parameter)]): the frozen parameters the engine shards;
    they stay on the meta device (the engine allocates this rank's shards) and the steps name
    them too. A module with parameters but no way to initialise them (no reset_parameters, no
    ancestor with one, no init_fn) is an error naming it."""
    sharded = {id(p): n for n, p in frozen or ()}
    for t in _tensors(model):
        if t.is_meta and not (isinstance(t, torch.nn.Parameter) and (t.requires_grad or id(t) in sharded)):
            _C._set_tensor_data(t, torch.zeros(t.shape, dtype=t.dtype, device=device))
    init_fn = init_fn or default_init_fn(model)
    trained = {id(p): n for g in groups for n, p in zip(g["names"], g["params"])}
    trained.update(sharded)
    steps, uninitialised, resetting = [], [], []
    for name, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        if not params and not buffers:
            continue
        names = [trained[id(p)] for p in params if id(p) in trained]
        if init_fn is not None:
            run = functools.partial(init_fn, module)
        elif callable(getattr(module, "reset_parameters", None)):
            run = module.reset_parameters
            resetting.append(name)
        else:
            # An ancestor's reset_parameters may write them (the engine then runs it with them).
            if any(id(p) not in sharded for p in params if id(p) in trained) and \
                    not any(name.startswith(a + ".") or not a for a in resetting):
                uninitialised.append(f"'{name or '<model>'}' ({type(module).__name__})")
            continue
        steps.append((name or "<model>", names, run))
    if uninitialised:
        raise ValueError("zeroshard.initialize: a model on the meta device is initialised module by module with "
                         "reset_parameters(), but " + ", ".join(uninitialised[:10]) +
                         (f" and {len(uninitialised) - 10} more" if len(uninitialised) > 10 else "") +
                         " hold parameters and have none; pass initialize(..., init_fn=fn), called as fn(module) "
                         "for every module holding parameters or buffers of its own")
    return steps
