"""Frozen parameters (requires_grad=False: a LoRA base, a frozen embedding) as the engine holds
them (docs/planner.md, "Frozen parameters"):

- stages 0-2: whole on every rank, in their own dtype, with no gradient, master copy or
  optimizer state;
- stage 3: in the unit the trained ones would be in (stage3/unit_builder.cpp assignUnits);
  within a unit, those of more than stage3_param_persistence_threshold elements form one flat
  buffer per dtype (the dtypes in order of first appearance), padded as a trained unit's buffer
  (FlatLayout), of which each rank holds its shard; the others stay whole on every rank. With
  offload_param the shards are in host memory;
- gathered with their unit: for its forward, and again for its backward where the unit is
  resharded after its forward (every unit but the root, unless reshard_after_forward is off)
  and has a backward: a unit of frozen parameters only, below every trained one (the lower
  layers frozen, the embedding too), computes no gradient and is not gathered again. So they
  are in gathered_peak and in the all-gathers' traffic; never reduced.
memory_stats() reports their bytes as "frozen" (host_frozen, device_frozen), in its total.
"""

from dataclasses import dataclass

from zeroshard.planner.model_params import ROOT
from zeroshard.planner.state_bytes import padded_numel


@dataclass(frozen=True)
class FrozenBuffers:
    """units (stage 3): (unit name, root?, ((dtype, padded elements, bytes per element), ...))
    for every unit with a flat frozen buffer; whole: the bytes every rank holds whole (every
    frozen parameter below stage 3, the small ones at stage 3)."""

    units: tuple = ()
    whole: int = 0
    no_backward: frozenset = frozenset()  # units whose outputs need no gradient

    def shard_bytes(self, world_size):
        """Bytes of one rank's shards of the flat buffers (world_size: the shard group's)."""
        return sum(n // world_size * size for _, _, groups in self.units for _, n, size in groups)

    def gathered(self):
        """{unit name: (bytes, elements)} of each unit's buffers when gathered."""
        return {name: (sum(n * size for _, n, size in groups), sum(n for _, n, _ in groups))
                for name, _, groups in self.units}

    def gathers_per_micro_batch(self, reshard_after_forward):
        """Bytes one rank all-gathers per micro-batch: every buffer for the forward, and again
        for the backward those of the units released after their forward."""
        forward = sum(n * size for _, _, groups in self.units for _, n, size in groups)
        backward = sum(n * size for name, root, groups in self.units if not root and name not in self.no_backward
                       for _, n, size in groups)
        return forward + (backward if reshard_after_forward else 0)


def frozen_buffers(model, stage, world_size, persistence_threshold):
    """FrozenBuffers of a ModelParams at `stage` for shards over world_size ranks."""
    numel = dict(model.params)
    dtype = {f.name: (f.dtype, f.itemsize) for f in model.frozen}
    if stage < 3:
        return FrozenBuffers(whole=sum(numel[f.name] * f.itemsize for f in model.frozen))
    units, whole = [], 0
    # A unit's outputs need a gradient once it or a unit before it trains a parameter, or the
    # model's first parameter (its embedding) is trained.
    trained = {n for n, _ in model.trained}
    grad_flows = bool(model.params) and model.params[0][0] in trained
    no_backward = set()
    for unit, names in model.units:
        if unit != ROOT:
            grad_flows = grad_flows or any(n in trained for n in names)
            if not grad_flows:
                no_backward.add(unit)
    for unit, names in model.units:
        groups = {}  # dtype -> [elements, bytes per element], in order of first appearance
        for name in (n for n in names if n in dtype):
            kind, size = dtype[name]
            if numel[name] <= persistence_threshold:
                whole += numel[name] * size
            else:
                groups.setdefault(kind, [0, size])[0] += numel[name]
        if groups:
            padded = tuple((kind, padded_numel(n, world_size), size) for kind, (n, size) in groups.items())
            units.append((unit, unit == ROOT, padded))
    return FrozenBuffers(tuple(units), whole, frozenset(no_backward))


def estimated_frozen(elements, itemsize, stage, layers=None):
    """FrozenBuffers of `elements` frozen parameters known only by their count (--params with
    --trainable-fraction), unpadded: whole below stage 3; at stage 3 `layers` equal units named
    as estimated_buffers names them (one when the units are unknown)."""
    if not elements:
        return FrozenBuffers()
    if stage < 3:
        return FrozenBuffers(whole=elements * itemsize)
    count = layers or 1
    return FrozenBuffers(tuple((str(i), False, (("", elements // count, itemsize),)) for i in range(count)))


def frozen_state(frozen, world_size, offload_params=False):
    """{"frozen", "host_frozen", "device_frozen"}: memory_stats()'s bytes of the frozen
    parameters on one rank (world_size: the shard group's)."""
    shards = frozen.shard_bytes(world_size)
    host = shards if offload_params else 0
    return {"frozen": shards + frozen.whole, "host_frozen": host, "device_frozen": shards + frozen.whole - host}
