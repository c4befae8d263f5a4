"""The flat buffers zeroshard.initialize would build for a model, without building them: the
same bucketing, units and padding as the C++ layout, so that the planner's model-state bytes are
memory_stats()'s exactly.

What is mirrored, and from where:
- buckets (stages 0-2): the trainable parameters of one param group, walked from the last to
  the first, a bucket closed as soon as it holds reduce_bucket_size elements or more
  (layout/param_groups.cpp, bucketParamGroups);
- units (stage 3): one per unit spec (stage3.find_units and the rule of
  stage3/unit_builder.cpp assignUnits, planner.model_params), the root last; parameters of at most
  stage3_param_persistence_threshold elements leave their unit for one kept unit, after the
  others; a unit left with no parameter is no buffer (buildStage3Units);
- padding: every buffer rounded up to SHARD_ALIGNMENT elements per shard (FlatLayout);
- frozen parameters: whole below stage 3, per unit and dtype at stage 3 (planner.frozen).
One param group (initialize without param_groups); several groups bucket each on its own.
The mirror is Python, against STYLE's thin layer, because the C++ layout builds tensors: the
planner must run for a 70B model on a laptop. tests/python/test_planner.py holds the two equal.
"""

from dataclasses import dataclass
from typing import Optional

from zeroshard.planner.frozen import frozen_buffers, frozen_state
from zeroshard.planner.model_params import ROOT, ModelParams
from zeroshard.planner.state_bytes import model_state_bytes, offloaded_state_bytes, padded_numel

@dataclass(frozen=True)
class Tuning:
    """The config keys that shape the buffers and the step's transients, resolved by the engine's
    own config reader (zeroshard.Config: its defaults, its validation)."""

    reduce_bucket_size: int
    persistence_threshold: int
    prefetch_bucket_size: int
    max_live_parameters: int
    overlap_comm: bool
    max_inflight_reductions: int
    reshard_after_forward: bool
    reduce_in_fp32: bool
    unit_classes: tuple
    accumulation_steps: int

    @classmethod
    def of_config(cls, config, stage, world_size):
        """config: a zeroshard config (dict, JSON path or zeroshard.Config; None for the
        defaults) read at `stage` (its own stage key is replaced)."""
        import zeroshard

        if config is None:
            config = {}
        elif isinstance(config, str):
            config = zeroshard.Config.from_file(config).to_dict()
        elif isinstance(config, zeroshard.Config):
            config = config.to_dict()
        zero = dict(config.get("zero_optimization", {}), stage=stage)
        cfg = zeroshard.Config.from_dict({**config, "zero_optimization": zero})
        resolved = cfg.to_dict()
        z, extras = resolved["zero_optimization"], resolved["zeroshard"]
        if cfg.train_batch_size is not None or cfg.train_micro_batch_size_per_gpu is not None:
            steps = cfg.batch_sizes(world_size)["gradient_accumulation_steps"]
        else:
            steps = cfg.gradient_accumulation_steps or 1
        return cls(reduce_bucket_size=z["reduce_bucket_size"],
                   persistence_threshold=z["stage3_param_persistence_threshold"],
                   prefetch_bucket_size=z["stage3_prefetch_bucket_size"],
                   max_live_parameters=z["stage3_max_live_parameters"], overlap_comm=z.get("overlap_comm", True),
                   max_inflight_reductions=extras["max_inflight_reductions"],
                   reshard_after_forward=extras["reshard_after_forward"],
                   reduce_in_fp32=extras["reduce_dtype"] == "fp32", unit_classes=tuple(extras["stage3_unit_classes"]),
                   accumulation_steps=steps)


@dataclass(frozen=True)
class Buffers:
    """The padded elements of every flat buffer of trained parameters one stage builds for
    shards over world_size ranks. Below stage 3: the buckets, in the order the engine builds
    them. At stage 3: the units that are gathered and released (`root` flags the root unit's,
    `units` names each), then `kept`, the padded elements of the unit kept gathered (0 when there
    is none)."""

    padded: tuple
    root: tuple = ()
    kept: int = 0
    units: tuple = ()

    @property
    def total(self):
        return sum(self.padded) + self.kept

    @property
    def largest(self):
        return max(self.padded + (self.kept,))

    @property
    def root_numel(self):
        return sum(n for n, root in zip(self.padded, self.root) if root)


def bucket_numels(numels, capacity):
    """Elements of each bucket of one param group, as bucketParamGroups fills them: the
    parameters from last to first, a bucket closed once it holds `capacity` elements or more."""
    buckets, filled = [], 0
    for n in reversed(numels):
        filled += n
        if filled >= capacity:
            buckets.append(filled)
            filled = 0
    if filled:
        buckets.append(filled)
    return buckets


def buffers(model, stage, world_size, tuning):
    """Buffers of a ModelParams at `stage` (0-3) for shards over world_size ranks."""
    if stage < 3:
        sizes = bucket_numels([n for _, n in model.trained], tuning.reduce_bucket_size)
        return Buffers(tuple(padded_numel(n, world_size) for n in sizes))
    numel = dict(model.trained)
    padded, root, kept, names = [], [], [], []
    for name, params in model.units:
        params = [p for p in params if p in numel]
        released = [numel[p] for p in params if numel[p] > tuning.persistence_threshold]
        kept += [numel[p] for p in params if numel[p] <= tuning.persistence_threshold]
        if released:
            padded.append(padded_numel(sum(released), world_size))
            root.append(name == ROOT)
            names.append(name)
    # A buffer is never empty: FlatLayout pads even one of no elements to one aligned block per shard.
    kept_padded = max(padded_numel(sum(kept), world_size), padded_numel(1, world_size)) if kept else 0
    return Buffers(tuple(padded), tuple(root), kept_padded, tuple(names))


def fp32_grad_shard(stage, precision, tuning):
    """Whether a 16-bit run's gradient shard is fp32 (Note [gradient shard dtype],
    grad/grad_storage.cpp): at stages 2-3 when it accumulates micro-batches or takes fp32 sums,
    at stage 1 (beside the whole 16-bit gradients) when it takes fp32 sums."""
    if precision == "fp32" or stage == 0:
        return False
    return tuning.reduce_in_fp32 or (stage >= 2 and tuning.accumulation_steps > 1)


def model_state(model, stage, world_size, precision="bf16", config=None, offload_optimizer=False,
                offload_params=False):
    """{"params", "grads", "optimizer", "frozen", "total"}: the bytes memory_stats() reports for
    `model` (an nn.Module, or a ModelParams) at `stage` over world_size ranks (the shard group's
    size with hybrid sharding) in `precision` ("fp32", "bf16", "fp16"), under `config` (the
    zeroshard config's bucket size, persistence threshold, accumulation and reduce dtype; None:
    the defaults). params, grads and optimizer are the trained parameters'; frozen the frozen
    ones' (planner.frozen). With offload (stages 1-3; offload_params at stage 3) also host_*
    and device_* of each, and of the total."""
    params = model if isinstance(model, ModelParams) else None
    tuning = Tuning.of_config(config, stage, world_size)
    if params is None:
        params = ModelParams.of_module(model, tuning.unit_classes)
    bufs = buffers(params, stage, world_size, tuning)
    wide = fp32_grad_shard(stage, precision, tuning)
    frozen = frozen_state(frozen_buffers(params, stage, world_size, tuning.persistence_threshold), world_size,
                          offload_params)
    if not (offload_optimizer or offload_params):
        state = model_state_bytes(stage, world_size, bufs.total, precision, bufs.kept, wide)
        return {**state, "frozen": frozen["frozen"], "total": sum(state.values()) + frozen["frozen"]}
    split = {**offloaded_state_bytes(stage, world_size, bufs.total, precision, offload_optimizer, offload_params,
                                     wide, bufs.kept), **frozen}
    for place in ("host", "device"):
        split[f"{place}_total"] = sum(split[f"{place}_{k}"] for k in ("params", "grads", "optimizer", "frozen"))
    whole = {k: split[f"host_{k}"] + split[f"device_{k}"] for k in ("params", "grads", "optimizer", "frozen", "total")}
    return {**whole, **split}


def estimated_buffers(elements, stage, layers: Optional[int], tuning):
    """Buffers of a model known only by its parameter count (--params), unpadded: buckets of
    reduce_bucket_size below stage 3; at stage 3 `layers` equal units (no root: a count cannot
    place one), or None when the units are unknown."""
    if stage < 3:
        full, rest = divmod(elements, tuning.reduce_bucket_size)
        return Buffers(tuple([tuning.reduce_bucket_size] * full + ([rest] if rest else [])))
    if not layers:
        return None
    return Buffers(tuple([elements // layers] * layers), (False,) * layers, units=tuple(map(str, range(layers))))
