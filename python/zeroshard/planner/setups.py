"""What one card holds under each setup (a stage, hybrid sharding, offload) for a model on N
cards of some memory: model states, activations, transients, total, whether it fits, and the
step's traffic; the setups in order, cheapest first.

Model states: the trained parameters' (params, grads, optimizer) and the frozen parameters'
(planner.frozen), on the card and in host memory.

Transients (engine.memory_stats()'s peaks, not in its total):
- stage 3's gathered units: the root unit (gathered from its forward to its backward) plus the
  unit in use and the one prefetched (two of the largest block), trained parameters in the
  compute dtype and frozen ones in theirs;
- the gradient staging buffers of stages 2-3, in the compute dtype: the largest bucket with
  overlap_comm off, else the max_inflight_reductions + 1 largest (unset, overlap_comm is on for
  GPU gradients, which the cards planned for hold); at stage 3 also the root and
  kept units' (fp32 sums add 4 bytes per element); at stages 0-1 only reduce_dtype "fp32"
  stages buckets (their fp32 copies);
- 16-bit training: the fp32 copy of one gradient shard the optimizer step makes at a time.
"""

from dataclasses import dataclass, field
from typing import Optional

from zeroshard.planner import activations as act
from zeroshard.planner.frozen import estimated_frozen, frozen_buffers, frozen_state
from zeroshard.planner.layout import Tuning, buffers, estimated_buffers, fp32_grad_shard
from zeroshard.planner.model_params import ROOT
from zeroshard.planner.state_bytes import ELEMENT_BYTES, model_state_bytes, offloaded_state_bytes
from zeroshard.planner.traffic import ring_seconds, step_traffic

STATES = ("frozen", "params", "grads", "optimizer")  # frozen: the frozen parameters'; the rest the trained ones'
TIGHT = 0.10  # headroom under this share of the card: CUDA context, allocator and NCCL buffers need it


@dataclass(frozen=True)
class ModelSource:
    """The model the plan is for: its parameter count, and as much of its structure as is known
    (ModelParams: exact buffers; TransformerShape: activations; layers: estimated stage-3 units).
    frozen_numel: of a count alone (--params), the elements frozen, in the compute dtype."""

    description: str
    numel: int
    params: Optional[object] = None
    shape: Optional[object] = None
    layers: Optional[int] = None
    notes: tuple = ()
    frozen_numel: int = 0

    @property
    def frozen(self):
        """Elements of the frozen parameters."""
        return self.params.frozen_numel if self.params is not None else self.frozen_numel

    @property
    def trained(self):
        return self.numel - self.frozen


@dataclass(frozen=True)
class Setup:
    stage: int
    shard_group: Optional[int] = None  # hybrid: shard over this many ranks, replicate across
    offload_optimizer: bool = False
    offload_params: bool = False

    def name(self, gpus):
        text = "DDP (stage 0)" if self.stage == 0 else f"stage {self.stage}"
        if self.shard_group:
            text += f", shard {self.shard_group} x {gpus // self.shard_group} copies"
        if self.offload_optimizer:
            text += " + offload optimizer" + ("+params" if self.offload_params else "")
        return text


def setups(gpus, shard_group=None, offload=False):
    """Every setup the flags ask for: stages 0-3, hybrid stages 1-3, optimizer offload at stages
    1-3 and parameter offload too at stage 3."""
    out = [Setup(stage) for stage in range(4)]
    if shard_group:
        out += [Setup(stage, shard_group) for stage in (1, 2, 3)]
    if offload:
        out += [Setup(stage, offload_optimizer=True) for stage in (1, 2, 3)]
        out.append(Setup(3, offload_optimizer=True, offload_params=True))
    return out


@dataclass
class Card:
    """One setup's numbers per card (bytes), as the report prints them."""

    setup: Setup
    name: str
    device: dict
    host: dict
    activations: Optional[int]
    transient: dict
    total: int
    traffic: dict
    not_counted: list = field(default_factory=list)
    comm_seconds: Optional[float] = None

    @property
    def model_states(self):
        return sum(self.device[k] for k in STATES)

    def headroom(self, memory):
        return memory - self.total

    def fit(self, memory):
        headroom = self.headroom(memory)
        return "fits" if headroom >= TIGHT * memory else "tight" if headroom >= 0 else "no"


def card(setup, model, gpus, precision, config=None, seq=2048, micro_batch=1, checkpointing=False,
         bandwidth=None):
    """The Card of `setup` for ModelSource `model` on `gpus` cards."""
    stage, group = setup.stage, setup.shard_group or gpus
    replicas = gpus // group
    tuning = Tuning.of_config(config, stage, gpus)
    compute = ELEMENT_BYTES[precision]["params"]
    if model.params is not None:
        bufs = buffers(model.params, stage, group, tuning)
        frozen = frozen_buffers(model.params, stage, group, tuning.persistence_threshold)
    else:
        bufs = estimated_buffers(model.trained, stage, model.layers, tuning)
        frozen = estimated_frozen(model.frozen, compute, stage, model.layers)
    elements = bufs.total if model.params is not None else model.trained
    wide = fp32_grad_shard(stage, precision, tuning)
    kept = bufs.kept if bufs is not None else 0
    host = dict.fromkeys(STATES[1:], 0)
    if setup.offload_optimizer or setup.offload_params:
        split = offloaded_state_bytes(stage, group, elements, precision, setup.offload_optimizer,
                                      setup.offload_params, wide, kept)
        device = {k: split[f"device_{k}"] for k in STATES[1:]}
        host = {k: split[f"host_{k}"] for k in STATES[1:]}
    else:
        device = model_state_bytes(stage, group, elements, precision, kept, wide)
    frozen_bytes = frozen_state(frozen, group, setup.offload_params)
    device = {"frozen": frozen_bytes["device_frozen"], **device}
    host = {"frozen": frozen_bytes["host_frozen"], **host}
    reduce = 4 if tuning.reduce_in_fp32 else compute
    not_counted = []
    transient = _transients(stage, bufs, frozen, group, compute, reduce, wide, tuning, not_counted)
    activations = None
    if model.shape is not None:
        activations = act.activation_bytes(model.shape, seq, micro_batch, precision, checkpointing)
    else:
        not_counted.append("activations (give --model config.json, or --hidden, --layers and --heads)")
    total = sum(device.values()) + sum(transient.values()) + (activations or 0)
    traffic = step_traffic(stage, bufs, elements, group, compute, reduce, tuning, replicas,
                           4 if wide else compute, setup.offload_optimizer,
                           frozen.gathers_per_micro_batch(tuning.reshard_after_forward))
    seconds = ring_seconds(traffic, group, replicas, bandwidth) if bandwidth else None
    return Card(setup, setup.name(gpus), device, host, activations, transient, total, traffic, not_counted,
                seconds)


def _gathered(bufs, frozen, compute, tuning):
    """Stage 3's gathered peak: the root unit, and the largest other unit (by bytes) twice when
    it is prefetched (once where stage3_max_live_parameters, in elements, stops the prefetch)."""
    units = {name: [compute * n, n] for name, n in zip(bufs.units, bufs.padded)}
    for name, (nbytes, numel) in frozen.gathered().items():
        unit = units.setdefault(name, [0, 0])
        unit[0] += nbytes
        unit[1] += numel
    root = units.pop(ROOT, (0, 0))
    largest = max(units.values(), default=(0, 0))
    blocks = 2 if tuning.prefetch_bucket_size > 0 else 1
    if root[1] + blocks * largest[1] > tuning.max_live_parameters:
        blocks = 1
    return root[0] + blocks * largest[0]


def _transients(stage, bufs, frozen, group, compute, reduce, wide, tuning, not_counted):
    gathered = staging = fp32_grads = 0
    if bufs is None:
        not_counted.append("stage 3's gathered units, staging and fp32 gradient copy (give --layers, or "
                           "--model / --module for the units)")
        return {"gathered": 0, "staging": 0, "fp32_grads": 0}
    if stage == 3:
        gathered = _gathered(bufs, frozen, compute, tuning)
    # Note [staging lifetime] (grad/grad_reducer.cpp): a buffer is staged from its first gradient
    # to its reduction's end, and up to max_inflight_reductions reductions run beside the one
    # being filled. Stage 3's root and kept units fill over the whole backward (the head's and the
    # last norm's gradients come first, the embedding's and the first norm's last).
    in_flight = tuning.max_inflight_reductions + 1 if tuning.overlap_comm else 1
    if stage == 3:
        blocks = sorted((n for n, root in zip(bufs.padded, bufs.root) if not root), reverse=True)
        staged = bufs.root_numel + bufs.kept + sum(blocks[:in_flight])
    else:
        staged = sum(sorted(bufs.padded, reverse=True)[:in_flight])
    if stage >= 2:
        staging = staged * (compute + (4 if reduce != compute else 0))
    elif reduce != compute:
        staging = staged * 4
    if compute != 4 and not wide:
        fp32_grads = 4 * (bufs.largest if stage == 0 else bufs.largest // group)
    return {"gathered": gathered, "staging": staging, "fp32_grads": fp32_grads}


ORDER = ("cheapest first: fewest bytes per rank per step (DDP and stages 1-2 move the same 2Ψ, stage 3 "
         "3Ψ, hybrid sharding adds an all-reduce of each shard across the groups), then the lower stage (fewer "
         "collectives, no gathers in the forward), offload last (a host AdamW step and 8Ψ/N bytes over PCIe "
         "every step)")


def ordered(cards):
    """Cheapest first (ORDER says why)."""
    def cost(c):
        return (c.setup.offload_optimizer, c.traffic["intra"] + c.traffic["inter"], c.setup.stage,
                c.setup.shard_group is not None, c.setup.offload_params)

    return sorted(cards, key=cost)
