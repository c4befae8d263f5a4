"""What tests/python/test_frozen.py and test_frozen_state.py train with: the config and the
frozen base's values (a LoRA-like model from models.py)."""

from training import engine_config

STEPS = range(3)
PERSIST = 30  # stage3_param_persistence_threshold: the biases and norms of a block stay whole


def config(stage, **kwargs):
    zero = {"stage3_param_persistence_threshold": PERSIST, **kwargs.pop("zero", {})}
    return engine_config(stage, zero=zero, **kwargs)


def frozen_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
