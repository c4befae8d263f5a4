"""Bytes of model state one rank holds between steps, by ZeRO stage: parameters, gradients and
optimizer state (AdamW's exp_avg and exp_avg_sq, and the fp32 master weights in 16-bit training).

The formulas live here once: the planner (`python -m zeroshard plan`) prints them, the tests
hold engine.memory_stats() to them exactly (with the padding of every flat buffer), and the
benchmarks (benchmarks/model_state.py) print them beside what each peer measured. Pure
arithmetic on element counts: nothing here reads a model or the engine.
"""

SHARD_ALIGNMENT = 16  # elements per shard boundary: FlatLayout::kShardAlignment

# Bytes per element of each state. In fp32 the parameters are the master weights; in 16 bits the
# fp32 master (4 bytes) is counted with the optimizer state, as memory_stats() counts it.
ELEMENT_BYTES = {
    "fp32": {"params": 4, "grads": 4, "optimizer": 8},
    "bf16": {"params": 2, "grads": 2, "optimizer": 12},
    "fp16": {"params": 2, "grads": 2, "optimizer": 12},
}

# The states each stage shards over the ranks; every rank holds the others whole.
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def padded_numel(elements, world_size):
    """Elements of a flat buffer (a bucket below stage 3, a unit at stage 3) that holds
    `elements`: rounded up so that each of the world_size shards is a multiple of
    SHARD_ALIGNMENT (FlatLayout's constructor)."""
    step = SHARD_ALIGNMENT * world_size
    return -(-elements // step) * step


def persistent_numel(sizes, threshold):
    """Elements stage 3 keeps gathered: the parameters (of these sizes) of at most
    stage3_param_persistence_threshold elements."""
    return sum(n for n in sizes if n <= threshold)


def model_state_bytes(stage, world_size, elements, precision="fp32", persistent=0, fp32_grad_shard=False):
    """{"params", "grads", "optimizer"}: bytes one rank holds for `elements` at `stage` over
    world_size ranks. Exact for padded elements (padded_numel, or the sum of the stage-3 units);
    for a plain parameter count, the estimate without padding (a few bytes under).

    persistent: stage 3's elements kept gathered, each with a whole copy of its parameter beside
    its shard. fp32_grad_shard: the gradient shard is fp32 whatever the precision (16-bit
    training with gradient accumulation, or reduce_dtype "fp32"): it replaces the 16-bit shard
    where gradients are sharded, and at stage 1 comes beside the whole 16-bit gradients."""
    assert persistent == 0 or stage == 3, "only stage 3 keeps parameters gathered"
    assert not fp32_grad_shard or stage >= 1, "stage 0 has no gradient shard"
    per_element = ELEMENT_BYTES[precision]
    sharded = SHARDED[stage]
    state = {name: b * elements // world_size if name in sharded else b * elements
             for name, b in per_element.items()}
    state["params"] += per_element["params"] * persistent
    if fp32_grad_shard:
        shard = ELEMENT_BYTES["fp32"]["grads"] * elements // world_size
        state["grads"] = shard if "grads" in sharded else state["grads"] + shard
    return state


def bytes_per_param(stage, world_size, precision="fp32", persistent=None):
    """model_state_bytes per parameter as the benchmarks print it: the whole states plus the
    sharded ones over the ranks ("8 + 8/2"); at stage 3 with `persistent` kept elements, the
    bytes of their whole copies too ("16/2, + 4 for 20,480 kept")."""
    per_element = ELEMENT_BYTES[precision]
    whole = sum(b for name, b in per_element.items() if name not in SHARDED[stage])
    split = sum(b for name, b in per_element.items() if name in SHARDED[stage])
    text = " + ".join(([str(whole)] if whole else []) + ([f"{split}/{world_size}"] if split else []))
    if persistent is not None:
        text += f", + {per_element['params']} for {persistent:,} kept"
    return text


def offloaded_state_bytes(stage, world_size, elements, precision="fp32", optimizer=True, params=False,
                          fp32_grad_shard=False, persistent=0):
    """memory_stats()'s bytes by place with ZeRO-Offload: {"host_params", "host_grads",
    "host_optimizer", "device_params", "device_grads", "device_optimizer"} for `elements`
    (padded, as model_state_bytes) at `stage` (1-3) over world_size ranks.

    optimizer (offload_optimizer "cpu"): the fp32 master shard, exp_avg and exp_avg_sq go to the
    host (12 bytes per element of the shard; the master is a copy of its own even in fp32,
    except where the fp32 parameter shard is in host memory too and is the master), and so does
    an fp32 copy of the gradient shard the host step reads (4 bytes); the device keeps its
    gradients as without offload. params (offload_param "cpu", stage 3): the parameter shards
    go to the host; alone, an fp32 run keeps a device copy of its master shard (4 bytes).
    persistent: as model_state_bytes; the whole copies of the kept parameters stay on the device."""
    assert stage >= 1 and (not params or stage == 3)
    base = model_state_bytes(stage, world_size, elements, precision, persistent, fp32_grad_shard)
    shard = elements // world_size
    host = {"params": 0, "grads": 0, "optimizer": 0}
    device = dict(base)
    if params:
        host["params"] = ELEMENT_BYTES[precision]["params"] * shard
        device["params"] -= host["params"]
    master_is_param_shard = precision == "fp32" and params
    if optimizer:
        host["grads"] = 4 * shard
        host["optimizer"] = (8 if master_is_param_shard else 12) * shard
        device["optimizer"] = 0
    elif master_is_param_shard:
        device["optimizer"] += 4 * shard
    return {**{f"host_{k}": v for k, v in host.items()}, **{f"device_{k}": v for k, v in device.items()}}
