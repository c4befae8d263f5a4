"""Bytes of model state one rank holds between steps, by ZeRO stage (see
zeroshard/planner/state_bytes.py, where the formulas live once: the planner, the tests and the
benchmarks print the same numbers), and the two counts the benchmarks and tests take from their
own models (`model.blocks` are the stage-3 units of every model they build).
"""

from zeroshard.planner.state_bytes import (
    ELEMENT_BYTES,
    SHARD_ALIGNMENT,
    SHARDED,
    bytes_per_param,
    model_state_bytes,
    offloaded_state_bytes,
    padded_numel,
    persistent_numel,
)

# The names the benchmarks and tests import from here.
__all__ = ["ELEMENT_BYTES", "SHARD_ALIGNMENT", "SHARDED", "bytes_per_param", "model_state_bytes",
           "offloaded_state_bytes", "padded_numel", "persistent_numel", "param_numel", "stage3_unit_numels"]


def param_numel(module):
    """Elements of a module's parameters, a tied one counted once."""
    return sum(p.numel() for p in module.parameters())


def stage3_unit_numels(model, world_size):
    """Padded elements of each stage-3 unit of a model whose units are `model.blocks`: the
    blocks in order, then the root (every other parameter), each padded on its own."""
    blocks = [param_numel(block) for block in model.blocks]
    return [padded_numel(n, world_size) for n in blocks + [param_numel(model) - sum(blocks)]]
