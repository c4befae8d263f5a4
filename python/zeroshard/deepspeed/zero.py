"""deepspeed.zero: GatheredParameters and Init.

GatheredParameters(params, modifier_rank=None): inside, the given parameters are whole. With
modifier_rank=r, what rank r changed is broadcast to every rank on exit and written into the
engine's sharded state: the fp32 master weights the optimizer updates and the compute-dtype
parameters (Engine::setParameters). Unlike DeepSpeed, this also holds at stages 0-2, where
DeepSpeed's context does nothing and a change made on one rank stays on it. Without
modifier_rank it is for reading: changes made inside are not kept (stage 3 releases them; below
stage 3 the next optimizer step overwrites them).

A frozen parameter of an engine's model (sharded at stage 3, whole below it) is broadcast from
modifier_rank and written the same way, into this rank's slice of it at stage 3. Parameters of
no live engine (before initialize()) are left alone, as DeepSpeed leaves parameters it did not
partition.
"""

import weakref

import torch

from zeroshard._warnings import warn_at_caller

# Set on each parameter of an engine's model by initialize(): (weakref to the DeepSpeedEngine,
# the name the engine holds it under, trained or frozen). An attribute of the
# parameter, as DeepSpeed's ds_id is: the context is given parameters only.
OWNER_ATTR = "_zeroshard_deepspeed_owner"


def mark_owner(engine, model):
    ref = weakref.ref(engine)
    for name, param in model.named_parameters():
        setattr(param, OWNER_ATTR, (ref, name))


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self._by_engine = {}  # id(engine) -> (engine, [(name or None, param)])
        if not enabled:
            return
        if fwd_module is not None:
            raise NotImplementedError(
                "zeroshard.deepspeed.zero.GatheredParameters: fwd_module (parameters used by another module's "
                "forward) is not supported: zeroshard gathers a stage-3 unit's parameters for its own forward only")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        seen = set()
        for param in params:
            owner = getattr(param, OWNER_ATTR, None)
            engine = owner[0]() if owner else None
            if engine is None or id(param) in seen:
                continue
            seen.add(id(param))
            self._by_engine.setdefault(id(engine), (engine, []))[1].append((owner[1], param))

    def __enter__(self):
        entered = []
        try:
            for engine, _ in self._by_engine.values():
                engine._enter_gathered()
                entered.append(engine)
        except BaseException:
            for engine in entered:
                engine._exit_gathered()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            # After an exception inside, the ranks may not all get here: no collective then.
            if self.modifier_rank is not None and exc_type is None:
                for engine, named in self._by_engine.values():
                    engine._write_back(named, self.modifier_rank)
        finally:
            for engine, _ in self._by_engine.values():
                engine._exit_gathered()
        return False


class Init:
    """deepspeed.zero.Init(...): builds the model as usual (whole on every rank), with one warning.

    DeepSpeed creates the parameters already partitioned inside it; zeroshard shards them in
    initialize(), so a model built here takes its full size in each process's memory until then
    (docs/deepspeed.md). With enabled=False it is silent, as DeepSpeed's is inert."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs):
        self.enabled = enabled
        if module is not None and enabled:
            raise NotImplementedError("zeroshard.deepspeed.zero.Init(module=...) (partitioning a built module) is "
                                      "not supported; pass the model to initialize(), which shards it")

    def __enter__(self):
        if self.enabled:
            warn_at_caller("zeroshard.deepspeed.zero.Init builds the model whole (every parameter in full on every "
                           "rank) until initialize() shards it; DeepSpeed would create it partitioned")
        return self

    def __exit__(self, *exc):
        return False
