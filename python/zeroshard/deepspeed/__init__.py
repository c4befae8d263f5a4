"""DeepSpeed's training API over zeroshard: `import zeroshard.deepspeed as deepspeed`.

A script written for DeepSpeed (deepspeed.initialize, engine.backward / step,
save_checkpoint / load_checkpoint, deepspeed.zero.GatheredParameters, ...) runs after changing
that one import. What is supported and what differs: docs/deepspeed.md.
"""

import os

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.deepspeed import comm, utils, zero
from zeroshard.deepspeed.config import (drop_config_optimizer, keep_every_checkpoint, resolve_config,
                                        take_dataloader_drop_last)
from zeroshard.deepspeed.dataloader import DeepSpeedDataLoader
from zeroshard.deepspeed.distributed import add_config_arguments, init_distributed
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.optimizer import move_scheduler, param_groups_from, take_over

__all__ = ["DeepSpeedEngine", "DeepSpeedDataLoader", "add_config_arguments", "comm", "init_distributed",
           "initialize", "utils", "zero"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """deepspeed.initialize(): returns (engine, optimizer, training_dataloader, lr_scheduler).

    config: a path, a dict or base64 JSON (config_params is its older name; without either,
      args.deepspeed_config). optimizer: None (the config's 'optimizer' section), or a
      torch.optim.AdamW / Adam object, or a callable of the parameters returning one; it wins
      over the config's section. model_parameters: tensors or param-group dicts, as a torch
      optimizer takes them. lr_scheduler: a scheduler or a callable of the optimizer; it wins
      over the config's 'scheduler'. training_data: a Dataset, for the returned dataloader."""
    if model is None:
        raise ValueError("zeroshard.deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("zeroshard.deepspeed.initialize: model parallelism (mpu, mesh_param) is not "
                                  "supported; zeroshard shards over data-parallel ranks only")
    # What needs no other rank is checked first: a bad config or optimizer fails before any
    # process group exists.
    ds_config, _source = resolve_config(args, config, config_params)
    drop_last = take_dataloader_drop_last(ds_config)
    keep_every_checkpoint(ds_config)
    client_optimizer = None
    if optimizer is not None:
        client_optimizer, groups = take_over(optimizer, model, model_parameters)
        drop_config_optimizer(ds_config)
    else:
        groups = param_groups_from(model_parameters)
    _float_trained_parameters(model, ds_config)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine = zeroshard.initialize(model, ds_config, param_groups=groups, lr_scheduler=lr_scheduler)
    move_scheduler(engine.lr_scheduler, client_optimizer, engine.optimizer)
    group = dist.group.WORLD
    if hasattr(args, "local_rank"):
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    loader = None
    if training_data is not None:
        loader = DeepSpeedDataLoader(training_data, engine.train_micro_batch_size_per_gpu, dist.get_rank(group),
                                     dist.get_world_size(group), drop_last=drop_last, collate_fn=collate_fn)
    ds_engine = DeepSpeedEngine(engine, ds_config, group, training_dataloader=loader)
    zero.mark_owner(ds_engine, model)
    return ds_engine, ds_engine.optimizer, loader, ds_engine.lr_scheduler


def _float_trained_parameters(model, config):
    """A model already cast to the config's 16-bit dtype (DeepSpeed scripts often call
    model.half() / .bfloat16() first, and DeepSpeed takes its fp32 master copy from those
    values) has its trained parameters made float32 again: zeroshard seeds the master weights
    from float32 parameters and casts them itself, which gives DeepSpeed's numbers exactly."""
    dtypes = set()
    if _enabled(config, "bf16") or _enabled(config, "bfloat16"):
        dtypes.add(torch.bfloat16)
    if _enabled(config, "fp16"):
        dtypes.add(torch.float16)
    for param in model.parameters():
        if param.requires_grad and param.dtype in dtypes:
            param.data = param.data.float()


def _enabled(config, key):
    section = config.get(key)
    return isinstance(section, dict) and section.get("enabled") is True
