"""What deepspeed.initialize() takes as parameters and optimizer, turned into zeroshard param groups.

zeroshard runs one optimizer, AdamW with decoupled weight decay on its fp32 shards. A client
torch.optim.AdamW (or an Adam that is the same thing: no weight decay, or
decoupled_weight_decay=True) is taken over: its groups and hyper-parameters become the
engine's, and the object itself is not stepped. Anything else is refused by name rather than
trained differently from what the script asked for.
"""

import torch

_HYPER = ("lr", "betas", "eps", "weight_decay")


def _number(value):
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _trainable(params):
    # DeepSpeed accepts frozen parameters in its groups (they never get a gradient, so they
    # never move); zeroshard keeps them outside the engine.
    return [p for p in params if p.requires_grad]


def _checked_flags(group, index, where):
    for flag in ("amsgrad", "maximize"):
        if group.get(flag, False):
            raise ValueError(f"zeroshard.deepspeed.initialize: {where} param group {index} sets {flag}=True, "
                             "which zeroshard's AdamW does not run; remove it")


def param_groups_from(model_parameters):
    """DeepSpeed's model_parameters (None, tensors, or dicts as a torch optimizer takes them)
    as zeroshard param groups; None: every trainable parameter in one group."""
    if model_parameters is None:
        return None
    if isinstance(model_parameters, torch.Tensor):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        groups = []
        for i, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"zeroshard.deepspeed.initialize: model_parameters group {i} has no 'params'")
            _checked_flags(group, i, "model_parameters")
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            # Keys a torch optimizer would only carry along (e.g. a group's "name") are dropped.
            hyper = {k: group[k] for k in _HYPER if k in group}
            groups.append({"params": _trainable(params), **_normalized(hyper)})
    elif all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": _trainable(items)}]
    else:
        raise TypeError("zeroshard.deepspeed.initialize: model_parameters must be tensors or param-group dicts "
                        f"(as a torch optimizer takes them), got {sorted({type(i).__name__ for i in items})}")
    # DeepSpeed drops groups left without parameters.
    return [g for g in groups if g["params"]] or groups[:1]


def _normalized(hyper):
    out = {}
    for key, value in hyper.items():
        out[key] = tuple(_number(b) for b in value) if key == "betas" else _number(value)
    return out


def take_over(optimizer, model, model_parameters):
    """(the client optimizer, its param groups each with lr, betas, eps and weight_decay); a
    callable is called with the parameters first, as DeepSpeed does."""
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        params = list(model.parameters()) if model_parameters is None else list(model_parameters)
        optimizer = optimizer(params)
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise TypeError(
            f"zeroshard.deepspeed.initialize: optimizer {kind.__module__}.{kind.__qualname__} is not supported: "
            "zeroshard runs AdamW on its fp32 shards and takes over a torch.optim.AdamW or torch.optim.Adam; pass one "
            "of those, or leave optimizer=None and describe it in the config's 'optimizer' section")
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        _checked_flags(group, i, kind.__name__)
        decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        if not decoupled and _number(group["weight_decay"]) != 0:
            raise ValueError(
                f"zeroshard.deepspeed.initialize: torch.optim.Adam with weight_decay={_number(group['weight_decay'])} "
                f"(param group {i}) adds the decay to the gradient (L2), as DeepSpeed runs it; zeroshard's AdamW "
                "decays the weights directly, which trains differently. Use torch.optim.AdamW, or Adam with "
                "weight_decay=0")
        groups.append({"params": _trainable(group["params"]), **_normalized({k: group[k] for k in _HYPER})})
    if any(optimizer.state.values()):
        raise ValueError(f"zeroshard.deepspeed.initialize: the {kind.__name__} given has already stepped (it holds "
                         "state); zeroshard starts AdamW from fresh state, so pass an optimizer that has not stepped "
                         "(or load a checkpoint with engine.load_checkpoint)")
    return optimizer, [g for g in groups if g["params"]] or groups[:1]


def move_scheduler(scheduler, client_optimizer, engine_optimizer):
    """A scheduler the script built on its own optimizer before initialize() (the usual
    `get_linear_schedule_with_warmup(optimizer, ...)`) drives engine.optimizer instead: in
    DeepSpeed the client optimizer's param_groups are the engine's, here they are copies."""
    if scheduler is None or client_optimizer is None or getattr(scheduler, "optimizer", None) is not client_optimizer:
        return
    if len(client_optimizer.param_groups) != len(engine_optimizer.param_groups):
        raise ValueError("zeroshard.deepspeed.initialize: the lr_scheduler was built on an optimizer with "
                         f"{len(client_optimizer.param_groups)} param groups, of which "
                         f"{len(engine_optimizer.param_groups)} have trainable parameters; drop the groups "
                         "without any before building the scheduler")
    scheduler.optimizer = engine_optimizer
    # torch schedulers check at their first step that the optimizer stepped first, through a
    # wrapper they put on the step of the optimizer they were built on; engine.step() calls
    # engine.optimizer.step() at each boundary, so it gets the same marking.
    step = engine_optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def marked_step(*args, **kwargs):
        engine_optimizer._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True
    engine_optimizer.step = marked_step
