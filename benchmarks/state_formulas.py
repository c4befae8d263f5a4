"""What each benchmarked setup should hold in model state, in model_state.py's terms:
state_formula(name, ...) for any steps.make_step config, offload_formula for zeroshard's
ZeRO-Offload configs. steps.py re-exports both."""

from model_state import ELEMENT_BYTES, SHARDED, bytes_per_param, model_state_bytes, offloaded_state_bytes

# ZeRO-Offload, appended to a zeroshard config's stage (before "-bf16"): "-offload" puts the
# optimizer state in host memory (offload_optimizer "cpu", stages 1-3), "-offload+param" the
# stage-3 parameter shards too (offload_param "cpu"); pin_memory true for both.
OFFLOADS = {"": (), "-offload": ("optimizer",), "-offload+param": ("optimizer", "param")}


def zeroshard_config(name):
    """(stage, precision, offload) of a zeroshard config name: "zeroshard-stage<k>", then one of
    OFFLOADS' suffixes, then "-bf16" or nothing (fp32)."""
    bf16 = name.endswith("-bf16")
    base = name[:-len("-bf16")] if bf16 else name
    prefix = "zeroshard-stage"
    offload = OFFLOADS.get(base[len(prefix) + 1:])
    if not base.startswith(prefix) or not base[len(prefix):len(prefix) + 1].isdigit() or offload is None:
        raise ValueError(f"unknown zeroshard config {name!r}: expected zeroshard-stage<0-3>, then one of "
                         f"{', '.join(repr(k) for k in OFFLOADS)}, then '-bf16' or nothing")
    stage = int(base[len(prefix)])
    if (offload and stage == 0) or ("param" in offload and stage != 3):
        raise ValueError(f"config {name!r}: the optimizer is offloaded at stages 1-3, the parameters at stage 3 only")
    return stage, "bf16" if bf16 else "fp32", offload


# Each torch setup's model state in ZeRO terms: (the stage that shards the same states, the
# precision of its states, whether DDP's gradient buckets come on top).
_STATE_AS_ZERO = {"ddp": (0, "fp32", True), "ddp+zero-redundancy": (1, "fp32", True),
                  "ddp-autocast": (0, "fp32", True), "fsdp2": (3, "fp32", False), "fsdp2-bf16": (3, "fp32", False),
                  "plain-bf16": (0, "bf16", False), "plain-autocast": (0, "fp32", False)}


def offload_formula(name, elements, world_size, kept_params=0):
    """memory_stats()'s bytes by place (model_state.offloaded_state_bytes: host_params, ...,
    device_optimizer) of zeroshard config `name` with ZeRO-Offload, for `elements` (padded, or a
    parameter count for the estimate without padding), kept_params of them whole beside their
    shards at stage 3: those copies stay on the device, wherever the shards are."""
    stage, precision, offload = zeroshard_config(name)
    assert offload, f"{name} offloads nothing"
    state = offloaded_state_bytes(stage, world_size, elements, precision, optimizer="optimizer" in offload,
                                  params="param" in offload)
    state["device_params"] += ELEMENT_BYTES[precision]["params"] * kept_params
    return state


def _offload_text(name, world_size, kept_params):
    """offload_formula per parameter as text: "2 + 2/2 on the device, 16/2 on the host"."""
    stage, precision, offload = zeroshard_config(name)
    per = offloaded_state_bytes(stage, 1, 1, precision, optimizer="optimizer" in offload, params="param" in offload)

    # The host holds shards only (of the optimizer state, the fp32 gradients, the parameters).
    whole = sum(per[f"device_{k}"] for k in ELEMENT_BYTES[precision] if k not in SHARDED[stage])
    split = sum(per[f"device_{k}"] for k in ELEMENT_BYTES[precision] if k in SHARDED[stage])
    device = " + ".join(([str(whole)] if whole else []) + ([f"{split}/{world_size}"] if split else [])) or "0"
    text = f"{device} on the device, {sum(per[f'host_{k}'] for k in ELEMENT_BYTES[precision])}/{world_size} on the host"
    if stage == 3:
        text += f", + {ELEMENT_BYTES[precision]['params']} for {kept_params:,} kept"
    return text


def state_formula(name, num_params, world_size, kept_params=0):
    """(bytes per parameter as text, bytes) of model state that config `name` holds per rank
    for num_params parameters, kept_params of them below zeroshard stage 3's persistence
    threshold; with ZeRO-Offload, the bytes on the compute device only (offload_formula has both
    places). DDP's buckets are as large as the gradients (gradient_as_bucket_view=False, its
    default); FSDP2 keeps no gathered copy between steps; DDP under autocast and FSDP2 with a
    MixedPrecisionPolicy keep fp32 parameters, gradients and AdamW state, the bf16 copies being
    transient. A compiled config holds what its eager one does; DeepSpeed's rows are not
    measured (deepspeed_steps.py): None."""
    name = name.removesuffix("-compiled")
    if name.startswith("deepspeed-"):
        return None
    if name.startswith("zeroshard-stage"):
        stage, precision, offload = zeroshard_config(name)
        if offload:
            state = offload_formula(name, num_params, world_size, kept_params if stage == 3 else 0)
            return _offload_text(name, world_size, kept_params), sum(v for k, v in state.items()
                                                                      if k.startswith("device_"))
        kept = kept_params if stage == 3 else None
        state = model_state_bytes(stage, world_size, num_params, precision, persistent=kept or 0)
        return bytes_per_param(stage, world_size, precision, kept), sum(state.values())
    stage, precision, buckets = _STATE_AS_ZERO[name]
    state = model_state_bytes(stage, world_size, num_params, precision)
    text, total = bytes_per_param(stage, world_size, precision), sum(state.values())
    if buckets:
        text, total = text + f" + {ELEMENT_BYTES[precision]['grads']} buckets", total + state["grads"]
    return text, total
