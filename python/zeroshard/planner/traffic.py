"""Bytes one rank moves per optimizer step at each stage, counted as the engine's CommStats
counts them (Note [traffic], comm/communicator.h: every collective its buffer's bytes, an
all-reduce twice), and the time they take over a link.

Per step, with Ψ the padded elements of every buffer and G micro-batches per step: stage 0
all-reduces once (2Ψ); stage 1 reduce-scatters and all-gathers once (2Ψ); stage 2 reduce-scatters
every micro-batch (GΨ + Ψ); stage 3 per micro-batch all-gathers every unit for the forward,
again every unit but the root for the backward (the root stays gathered), and reduce-scatters
every unit (3Ψ less the root's backward gather), and after the step all-gathers the kept unit.
All-gathers move the compute dtype, reductions the reduce dtype (fp32 with reduce_dtype "fp32").
Stage 3 gathers each unit's frozen buffers with it, in their own dtype, and never reduces them.
Hybrid sharding adds one all-reduce of each gradient shard across the groups per step.

Time: a ring all-gather or reduce-scatter over n ranks sends (n-1)/n of its buffer from each
rank, so a step takes traffic x (n-1)/n / bandwidth, with the link's bandwidth per direction.
"""

LINKS = {
    "pcie4": (32e9, "PCIe 4.0 x16: 32 GB/s per direction"),
    "pcie5": (64e9, "PCIe 5.0 x16: 64 GB/s per direction"),
    "nvlink-a100": (300e9, "NVLink 3 (A100): 12 links, 300 GB/s per direction (600 GB/s both ways)"),
    "nvlink-h100": (450e9, "NVLink 4 (H100): 18 links, 450 GB/s per direction (900 GB/s both ways)"),
}
# Offload copies gradient shards to the host and master shards back over the card's PCIe link.
HOST_LINK = "pcie4"


def parse_link(text):
    """(bytes per second, description) of a --link value: a name of LINKS or GB/s."""
    if text in LINKS:
        return LINKS[text]
    try:
        value = float(text.removesuffix("GB/s").strip())
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"unknown link {text!r}: use one of {', '.join(LINKS)} or a bandwidth in GB/s "
                         "(the bus bandwidth `python -m zeroshard check` measures)")
    return value * 1e9, f"{value:g} GB/s per direction"


def step_traffic(stage, bufs, elements, shard_group, compute_bytes, reduce_bytes, tuning, replicas=1,
                 grad_shard_bytes=None, offload=False, frozen_gathers=0):
    """{"intra", "inter", "host"}: bytes per rank per step inside the shard group (of
    shard_group ranks), across the `replicas` groups (hybrid sharding), and between the card and
    the host (optimizer offload: the fp32 gradient shard down, the fp32 master shard back).
    bufs: layout.Buffers (None: stage-3 units unknown, counted as 3Ψ of `elements`);
    grad_shard_bytes: the gradient shard's bytes per element, which the replicas all-reduce;
    frozen_gathers: stage 3's bytes of frozen buffers gathered per micro-batch
    (FrozenBuffers.gathers_per_micro_batch)."""
    steps = tuning.accumulation_steps
    total = bufs.total if bufs is not None else elements
    if stage == 0:
        intra = 2 * reduce_bytes * total
    elif stage == 1:
        intra = (reduce_bytes + compute_bytes) * total
    elif stage == 2:
        intra = steps * reduce_bytes * total + compute_bytes * total
    else:
        released = sum(bufs.padded) if bufs is not None else elements
        backward = released - (bufs.root_numel if bufs is not None else 0)
        kept = bufs.kept if bufs is not None else 0
        per_micro = compute_bytes * (released + (backward if tuning.reshard_after_forward else 0))
        intra = steps * (per_micro + frozen_gathers + reduce_bytes * (released + kept)) + compute_bytes * kept
    shard = total // shard_group
    inter = 2 * (grad_shard_bytes or reduce_bytes) * shard if replicas > 1 else 0
    host = 8 * shard if offload else 0
    return {"intra": intra, "inter": inter, "host": host}


def ring_seconds(traffic, shard_group, replicas, bandwidth):
    """Seconds per step of `traffic` (step_traffic's) at `bandwidth` bytes/s for the collectives
    (both levels over the same link, one machine) and the host link's for the offload copies."""
    def ring(nbytes, ranks):
        return nbytes * (ranks - 1) / ranks / bandwidth if ranks > 1 else 0.0

    seconds = ring(traffic["intra"], shard_group) + ring(traffic["inter"], replicas)
    return seconds + traffic["host"] / LINKS[HOST_LINK][0]
