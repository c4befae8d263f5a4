"""The planner: what each ZeRO stage costs a card for a model, before renting the cards
(`python -m zeroshard plan`, docs/planner.md).

model_state(model, stage, world_size, precision, config) gives the bytes memory_stats() reports
for that model, from the same bucketing, units and padding as the engine, without building it.
"""

from zeroshard.planner.layout import ModelParams, Tuning, buffers, model_state

__all__ = ["ModelParams", "Tuning", "buffers", "model_state", "main"]


def main(argv=None):
    from zeroshard.planner.cli import main as cli_main

    return cli_main(argv)
