"""Quantized frozen weights, which stage 3 cannot shard (issue 30).

Stage 3 shards a frozen parameter (requires_grad=False, e.g. a LoRA base model) per unit in its
own floating-point dtype: the unit's frozen parameters of one dtype are laid out back to back in
a flat buffer and cut into equal shards at element boundaries. A quantized weight is not such an
array: bitsandbytes' Params4bit packs two 4-bit codes per uint8 in blocks whose scales live beside
the tensor (its quant_state), and Int8Params keeps its scales apart too. A flat slice of the
packed bytes means nothing without its block's scales, and all-gathering the bytes would not
bring them back. Stages 0-2 keep frozen weights whole on every rank and take them as they are.

The bitsandbytes classes are recognised by name: bitsandbytes need not be installed (nor is it
imported) for a model that does not use it.
"""

QUANTIZED_PARAMETER_CLASSES = ("Params4bit", "Int8Params")  # bitsandbytes.nn


def check_frozen_shardable(model, cfg):
    """Raises a ValueError naming the first frozen parameter that the plan would shard (stage 3)
    but cannot be: a bitsandbytes quantized parameter, or any frozen parameter whose dtype is not
    floating point. Does nothing when the plan keeps parameters whole (stages 0-2)."""
    if not cfg.params_sharded:
        return
    for name, param in model.named_parameters():
        kind = type(param).__name__
        if param.requires_grad or (kind not in QUANTIZED_PARAMETER_CLASSES and param.is_floating_point()):
            continue
        raise ValueError(
            f"zeroshard.initialize: zero_optimization.stage 3 cannot shard the frozen parameter '{name}' "
            f"({kind}, dtype {param.dtype}, shape {tuple(param.shape)}): stage 3 shards frozen weights per unit "
            "in their own floating-point dtype, and quantized weights (bitsandbytes 4-bit / 8-bit blocks, whose "
            "scales are kept beside the tensor) cannot be cut into flat shards. Use stage 2, which keeps frozen "
            "weights whole on every rank (the usual QLoRA setup), or load the base model in bf16 to shard it "
            "at stage 3")
