"""zeroshard.initialize(): collects the model's parameters by name (trained and frozen), finds
the process group, builds the C++ engine (zeroshard._C.Engine) and wraps it in an Engine
(engine.py).
"""

from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard import _C, auto as _auto, meta as _meta, stage3
from zeroshard import quantized as _quantized
from zeroshard._warnings import warn_at_caller
from zeroshard.engine import Engine
from zeroshard.launch import init_distributed
from zeroshard.logs import wire_logging
from zeroshard.lr_schedule import ConfigSchedule
from zeroshard.optimizer_view import EngineOptimizer


def _load_config(config):
    if isinstance(config, _C.Config):
        return config
    if isinstance(config, dict):
        return _C.Config.from_dict(config)
    if isinstance(config, (str, Path)):
        return _C.Config.from_file(str(config))
    raise TypeError(f"zeroshard.initialize: config must be a path, a dict or a zeroshard.Config, "
                    f"not {type(config).__name__}")


def _param_groups(model, param_groups):
    """[{"names", "params", and the group's lr, weight_decay, betas, eps}], named and checked in
    C++ (a tensor that is not the model's, a trainable parameter in no group, an unknown key)."""
    groups = None
    if param_groups is not None:
        groups = [g if isinstance(g, dict) else {"params": g} for g in param_groups]
        groups = [{**g, "params": list(g["params"])} if "params" in g else g for g in groups]
    return _C._param_groups(groups, list(model.named_parameters()))


def initialize(model, config, process_group=None, param_groups=None, auto=None, lr_scheduler=None, init_fn=None):
    """Wraps `model` for ZeRO training; returns an Engine.

    config: a path to a DeepSpeed-style JSON file, a dict, or a zeroshard.Config.
    process_group: the torch.distributed group to shard over (default: the world group,
      initialized from the torchrun environment if torch.distributed is not yet).
    param_groups: like a torch optimizer's, e.g. [{"params": decay}, {"params": no_decay,
      "weight_decay": 0.0}]; keys lr, weight_decay, betas, eps override the config.
    auto: values for the keys the config writes as "auto", by dotted path, e.g.
      {"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 2e-5}; the rest are derived
      (docs/config.md, "auto") or are one error naming them.
    lr_scheduler: a torch scheduler of engine.optimizer, or a callable taking engine.optimizer and
      returning one; stepped after every optimizer step taken. It replaces the config's
      `scheduler`, as in DeepSpeed.
    init_fn: for a model built on the meta device (under `with torch.device("meta"):`), which
      initialize allocates only this rank's share of and initialises module by module:
      init_fn(module) is called for every module holding parameters or buffers of its own and
      fills them in place. Default: each module's reset_parameters() (a Hugging Face model's
      _init_weights). docs/design.md, "Models on the meta device".
    """
    cfg = _load_config(config)
    if process_group is None:
        process_group = init_distributed(cfg.zeroshard.collective_timeout_seconds)
    cfg = _auto.resolve(cfg, model, auto, dist.get_world_size(process_group), dist.get_rank(process_group))
    _quantized.check_frozen_shardable(model, cfg)  # stage 3 refuses quantized frozen weights
    if lr_scheduler is not None and cfg.scheduler.enabled:
        warn_at_caller(f"zeroshard.initialize: the config's scheduler ({cfg.scheduler.type}) is not used: the "
                       "lr_scheduler passed to initialize replaces it, as in DeepSpeed")
        cfg = _C._without_scheduler(cfg)
    if lr_scheduler is not None:
        cfg = _immediate_nonfinite_check(cfg)
    meta = _meta.on_meta(model)
    if init_fn is not None and not meta:
        raise ValueError("zeroshard.initialize: init_fn initialises a model built on the meta device, but this "
                         f"model's parameters are on {next(model.parameters()).device}: build it under "
                         "`with torch.device(\"meta\"):`, or initialise it yourself and leave init_fn out")
    groups = _param_groups(model, param_groups)
    # Frozen parameters (requires_grad=False, e.g. a LoRA base) are sharded with their units at
    # stage 3 and kept whole below it; every rank starts from rank 0's (engine.h).
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    meta_init = {}
    if meta:
        device = _meta.engine_device(process_group)
        steps = _meta.init_steps(model, groups, device, init_fn, frozen if cfg.params_sharded else None)
        meta_init = dict(init_device=str(device), init_steps=steps)
    hooks = []
    units = None  # stage 3's, for Engine.compile
    if cfg.bf16_enabled or cfg.fp16_enabled:
        # The parameters become 16-bit; floating-point inputs are cast to match, as FSDP's
        # MixedPrecisionPolicy does. Buffers keep their dtype.
        dtype = torch.bfloat16 if cfg.bf16_enabled else torch.float16
        hooks.append(model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))
    if not cfg.params_sharded:
        core = _C.Engine(groups, process_group.group_name, cfg, frozen=frozen, **meta_init)
    else:
        units = stage3.find_units(model, cfg.zeroshard.stage3_unit_classes)
        core = _C.Engine(groups, process_group.group_name, cfg, stage3.unit_specs(model, units), frozen=frozen,
                         **meta_init)
        hooks += stage3.install_hooks(core, model, units)
    trained = {id(p): n for g in groups for n, p in zip(g["names"], g["params"])}
    core.set_module_state_from(list(model.state_dict(keep_vars=True).items()))
    if not meta:
        core.broadcast_module_state()  # buffers and whole frozen parameters, as rank 0 has them
    optimizer = EngineOptimizer(core, groups, cfg)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        if not callable(lr_scheduler):
            raise TypeError("zeroshard.initialize: lr_scheduler must be a scheduler (with step()) or a callable "
                            f"taking the optimizer, not {type(lr_scheduler).__name__}")
        lr_scheduler = lr_scheduler(optimizer)
    wire_logging(core)
    engine = Engine(model, core, cfg, hooks, trained, optimizer, lr_scheduler, units)
    if lr_scheduler is None and cfg.scheduler.enabled:
        engine.lr_scheduler = ConfigSchedule(core)  # stepped in C++, shown as DeepSpeed's object
    if cfg.compile.enabled:
        engine.compile()  # the config's backend and kwargs (docs/compile.md)
    return engine


def _immediate_nonfinite_check(cfg):
    """A torch scheduler steps right after the optimizer step, and cannot be rewound when the
    deferred check finds that step skipped a step later: with one, the check is immediate
    (docs/reliability.md)."""
    check = cfg.zeroshard.nonfinite_check
    if cfg.zeroshard.nonfinite == "off" or cfg.fp16_enabled:
        return cfg  # nothing is checked late: no check, or fp16's loss scaler at the step
    if check == "deferred":
        raise ValueError("zeroshard.nonfinite_check: \"deferred\" cannot be used with the lr_scheduler passed to "
                         "zeroshard.initialize: a torch scheduler steps after every optimizer step and cannot be "
                         "taken back when the step turns out skipped a step later; use \"auto\" or \"immediate\" "
                         "(an immediate check, a host synchronisation per step on a GPU), or the config's "
                         "\"scheduler\" (rewound in C++) instead of lr_scheduler")
    return _C._with_immediate_nonfinite_check(cfg) if check == "auto" else cfg


def _cast_inputs(dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(_module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook
