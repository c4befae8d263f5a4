"""Which config deepspeed.initialize() was given, read the way DeepSpeed reads it.

DeepSpeed's rules (deepspeed/__init__.py): `config` wins over `config_params` (kept for
backwards compatibility); `args.deepspeed_config` (or the deprecated `args.deepscale_config`)
is used when neither is given, and giving it together with `config` is an error. A string is a
file path (read as JSON, or as hjson, a JSON superset with comments, when hjson is installed as
it is with DeepSpeed), or else a base64-encoded JSON config. Duplicate keys are an error.
"""

import base64
import binascii
import copy
import json
import os

from zeroshard._warnings import warn_at_caller


def resolve_config(args, config, config_params):
    """The config dict (a copy: the drop-in takes its own keys out of it) and its source's name."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        warn_at_caller("zeroshard.deepspeed: --deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("zeroshard.deepspeed.initialize: args has both deepscale_config and deepspeed_config; "
                             "give only --deepspeed_config")
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError(
                "zeroshard.deepspeed.initialize: a config was given both as args.deepspeed_config "
                f"({args.deepspeed_config!r}) and as initialize(config=...) (or config_params=...); give one of them")
        config = args.deepspeed_config
    if config is None:
        raise ValueError("zeroshard.deepspeed.initialize: no config: pass --deepspeed_config <file> in args "
                         "(deepspeed.add_config_arguments(parser) adds it), or initialize(config=<path or dict>)")
    return load_config(config)


def load_config(config):
    if isinstance(config, dict):
        return copy.deepcopy(config), "<dict>"
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if not isinstance(config, str):
        raise TypeError("zeroshard.deepspeed.initialize: config must be a path, a dict or a base64-encoded JSON "
                        f"string, not {type(config).__name__}")
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            return _parse(f.read(), config), config
    try:
        text = base64.urlsafe_b64decode(config).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = None
    if text is not None:
        try:
            return _parse(text, "<base64 config>"), "<base64 config>"
        except ValueError:
            pass
    raise ValueError(f"zeroshard.deepspeed.initialize: config {config!r} is neither an existing file nor a "
                     "base64-encoded JSON config")


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse(text, source):
    try:
        config = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:
            raise ValueError(f"zeroshard.deepspeed: config {source} is not valid JSON ({json_error}); DeepSpeed also "
                             "reads hjson (comments, trailing commas), which needs `pip install hjson`") from None
        try:
            config = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as e:
            raise ValueError(f"zeroshard.deepspeed: config {source} is neither JSON nor hjson: {e}") from None
        except ValueError as e:  # a duplicate key
            raise ValueError(f"zeroshard.deepspeed: config {source}: {e}") from None
    except ValueError as e:  # a duplicate key
        raise ValueError(f"zeroshard.deepspeed: config {source}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"zeroshard.deepspeed: config {source} must be a JSON object, not {type(config).__name__}")
    return config


def take_dataloader_drop_last(config):
    """Removes and returns `dataloader_drop_last` (DeepSpeed's default false): the drop-in's
    dataloader reads it, so the engine config does not report it as ignored."""
    value = config.pop("dataloader_drop_last", False)
    if not isinstance(value, bool):
        raise ValueError(f"zeroshard.deepspeed: dataloader_drop_last must be true or false, got {value!r}")
    return value


def keep_every_checkpoint(config):
    """DeepSpeed keeps every checkpoint it saves; zeroshard keeps the last two unless told.
    The drop-in keeps them all unless the config's own zeroshard.checkpoint.keep_last says."""
    extras = config.setdefault("zeroshard", {})
    if isinstance(extras, dict):
        checkpoint = extras.setdefault("checkpoint", {})
        if isinstance(checkpoint, dict):
            checkpoint.setdefault("keep_last", 0)


def drop_config_optimizer(config):
    """A client optimizer wins over the config's `optimizer` section, as in DeepSpeed."""
    if "optimizer" in config:
        warn_at_caller("zeroshard.deepspeed: the config's 'optimizer' section is not used: the optimizer given "
                       "to initialize() is (as in DeepSpeed)")
        del config["optimizer"]
