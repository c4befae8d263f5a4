"""Activation bytes per card of one micro-batch of a transformer, held for its backward.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), section 4, with no tensor or sequence parallelism: one layer stores
s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations (11sbh + 5as²b for attention, 19sbh for the
MLP, 4sbh for the two layer norms; dropout masks at a byte), and the embedding, final norm,
output layer and fp32 cross-entropy 4·s·b·h·(1 + V/h) once (their p = 1 term). With full
activation checkpointing each layer keeps only its 16-bit input, 2·s·b·h, and the backward
recomputes one layer at a time, which then holds its full activations.

An estimate, not a count: the 5as²b attention scores are not stored by fused attention (SDPA's
flash and memory-efficient kernels), gated MLPs store a little more than 19sbh, and models
without dropout a little less. fp32 activations take twice the bytes.
"""


def layer_bytes(shape, seq, micro_batch):
    s, b, h, a = seq, micro_batch, shape.hidden, shape.heads
    return s * b * h * 34 + 5 * a * s * s * b


def activation_bytes(shape, seq, micro_batch, precision, checkpointing):
    """Bytes of activations one card holds at the end of a micro-batch's forward (the peak the
    backward starts from) for a TransformerShape, `seq` tokens and `micro_batch` sequences."""
    s, b, h = seq, micro_batch, shape.hidden
    layer = layer_bytes(shape, seq, micro_batch)
    layers = shape.layers * 2 * s * b * h + layer if checkpointing else shape.layers * layer
    total = layers + 4 * s * b * h + 4 * s * b * shape.vocab
    return total * (2 if precision == "fp32" else 1)


def formula(checkpointing):
    """The formula activation_bytes uses, as the planner prints it."""
    per_layer = "s*b*h*(34 + 5*a*s/h)"
    layers = f"L*2*s*b*h + {per_layer}" if checkpointing else f"L*{per_layer}"
    return f"{layers} + 4*s*b*h*(1 + V/h) bytes at 16 bits (Korthikanti et al. 2022)"
