"""Resolving "auto" in a config for a given model (the rules are config/auto_values.h, in C++):
the values the caller gives, the model's hidden size for the bucket sizes, the batch rule,
DeepSpeed's defaults; one error listing whatever is still open."""

import json

from zeroshard import _C
from zeroshard._log import get_logger

_FROM_WEIGHTS = "the weights (the most common second dimension of the 2-D parameters)"


def hidden_size(model):
    """(h, where it came from), as the Hugging Face integration reads it: model.config's
    hidden_size, else the largest of its hidden_sizes (also under text_config); without a model
    config, from the weights. (None, why) when neither says."""
    conf = getattr(model, "config", None)
    for where, c in (("model.config", conf), ("model.config.text_config", getattr(conf, "text_config", None))):
        if c is None:
            continue
        h = getattr(c, "hidden_size", None)
        if isinstance(h, int) and h > 0:
            return h, f"{where}.hidden_size"
        sizes = getattr(c, "hidden_sizes", None)
        if sizes:
            return max(sizes), f"max({where}.hidden_sizes)"
    shapes = [list(p.shape) for p in model.parameters() if p.requires_grad]
    return _C._hidden_size_from_shapes(shapes), _FROM_WEIGHTS


def _json_text(path, value):
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"zeroshard.initialize: auto[{path!r}] must be a JSON value (a number, a "
                         f"boolean, a string, a list or None), got {value!r}: {e}") from None


def resolve(cfg, model, given, world_size, rank):
    """The config with every "auto" filled in; rank 0 logs one line saying how."""
    given = dict(given or {})
    if not cfg.auto_keys and not given:
        return cfg
    h, source = hidden_size(model) if cfg.auto_keys else (None, "")
    texts = {path: _json_text(path, value) for path, value in given.items()}
    resolved, summary = _C._resolve_auto(cfg, texts, h, source, world_size)
    if summary and rank == 0:
        get_logger().info(summary)
    return resolved
