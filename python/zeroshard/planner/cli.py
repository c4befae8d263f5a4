"""python -m zeroshard plan: which ZeRO stage fits a model on N cards, before renting them.

    python -m zeroshard plan --params 8e9 --gpus 4 --gpu-memory 80GB
    python -m zeroshard plan --model config.json --gpus 8 --gpu-memory 24GB --seq 4096 --offload
    python -m zeroshard plan --module mypkg.models:build --gpus 4,8 --gpu-memory 24GB,48GB,80GB --json
    python -m zeroshard plan --model llama-3-70b --lora-rank 16 --gpus 4,8 --gpu-memory 24GB,80GB

Formulas and what is not counted: docs/planner.md.
"""

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys

from zeroshard.planner.freezing import (DEFAULT_TARGETS, LLAMA_TARGETS, check_unfrozen, lora_targets, trained_count,
                                        with_lora, with_trainable_fraction)
from zeroshard.planner.hf_config import ConfigKeyError, TransformerShape, model_params, read_config
from zeroshard.planner.known_models import KNOWN_MODELS, known_model
from zeroshard.planner.report import json_report, text_report
from zeroshard.planner.setups import ModelSource, card, ordered, setups
from zeroshard.planner.traffic import LINKS, parse_link

_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_BYTES = {"": 1e9, "tb": 1e12, "gb": 1e9, "mb": 1e6, "g": 1e9, "m": 1e6, "tib": 2**40, "gib": 2**30, "mib": 2**20}


def _number(text, units, what):
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    try:
        value = float(match.group(1)) * units[match.group(2)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
    return value


def parameter_count(text):
    """8e9, 8000000000, 8B, 70b, 1.5M: a parameter count (B = 1e9)."""
    return int(_number(text, _COUNTS, "a parameter count (8e9, 8B, 350M)"))


def memory_size(text):
    """80GB, 80 (GB), 74.5GiB, 500MB: bytes (GB = 1e9, GiB = 2**30)."""
    return int(_number(text, _BYTES, "a memory size (80GB, 24GiB, 500MB)"))


def _listed(parse):
    def parse_list(text):
        return [parse(item) for item in text.split(",") if item.strip()] or parse("")
    parse_list.__name__ = parse.__name__
    return parse_list


def _positive(text):
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction above 0 and at most 1 (0.1: a tenth of the "
                                         "parameters trained)")
    return value


def _names(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of module names (q_proj,v_proj)")
    return tuple(names)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m zeroshard plan", description=__doc__.split("\n\n")[0],
                                epilog="GB = 1e9 bytes. docs/planner.md has the formulas.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=parameter_count, help="parameter count (8e9, 70B)")
    source.add_argument("--model", metavar="CONFIG_JSON", help="a Hugging Face config.json, or a known model: "
                        + ", ".join(KNOWN_MODELS))
    source.add_argument("--module", metavar="PKG:FACTORY",
                        help="a factory returning the nn.Module, called under torch.device('meta')")
    p.add_argument("--gpus", type=_listed(_positive), default=[8], help="cards (4, or 4,8 for a grid; default 8)")
    p.add_argument("--gpu-memory", type=_listed(memory_size), default=[80 * 10**9],
                   help="memory per card (80GB, 24GiB; a list for a grid; default 80GB)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--seq", type=_positive, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch", type=_positive, default=1, help="sequences per card per micro-batch (default 1)")
    p.add_argument("--grad-accum", type=_positive, help="micro-batches per optimizer step (default: --config's, or 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="full activation checkpointing")
    p.add_argument("--offload", action="store_true", help="add optimizer (and stage-3 parameter) offload setups")
    p.add_argument("--shard-group", type=_positive, metavar="K", help="add hybrid setups: shard over K, replicate")
    p.add_argument("--link", help=f"{' | '.join(LINKS)} | <GB/s>: communication time per step")
    p.add_argument("--config", metavar="DS_CONFIG_JSON", help="a zeroshard / DeepSpeed config: its bucket size, "
                   "persistence threshold, accumulation and reduce dtype")
    shapes = p.add_argument_group("shapes, with --params (for activations and stage-3 units)")
    for flag in ("--hidden", "--layers", "--heads", "--vocab"):
        shapes.add_argument(flag, type=_positive)
    frozen = p.add_argument_group("frozen parameters (with --model or --module; --trainable-fraction also with "
                                  "--params), counted in the --dtype")
    how = frozen.add_mutually_exclusive_group()
    how.add_argument("--lora-rank", type=_positive, metavar="R", help="LoRA adapters of rank R (as peft's "
                     "get_peft_model) on a frozen base")
    how.add_argument("--trainable-fraction", type=_fraction, metavar="F", help="train the last parameters "
                     "(the head, the top layers), a fraction F of all (0 < F <= 1), and freeze the rest")
    frozen.add_argument("--lora-targets", type=_names, metavar="NAMES", help="the Linear layers given adapters, "
                        f"by their own names (default {','.join(DEFAULT_TARGETS)}; Llama's: {','.join(LLAMA_TARGETS)})")
    p.add_argument("--json", action="store_true", help="one JSON document with every number")
    return p


def _module_source(parser, spec, unit_classes):
    import torch

    from zeroshard.planner.layout import ModelParams

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        parser.error(f"argument --module: {spec!r} is not PKG:FACTORY (e.g. mypkg.models:build)")
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as e:
        parser.error(f"argument --module: cannot find {spec!r}: {e}")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # the user's factory: report it as the flag's error, no traceback
        parser.error(f"argument --module: {spec} raised {type(e).__name__}: {e}")
    if not isinstance(model, torch.nn.Module):
        parser.error(f"argument --module: {spec} returned a {type(model).__name__}, not an nn.Module")
    params = ModelParams.of_module(model, unit_classes)
    shape, notes = None, [f"{type(model).__name__} from {spec}, built on the meta device"]
    hf = getattr(model, "config", None)
    if hasattr(hf, "to_dict"):
        try:
            shape = model_params(hf.to_dict(), f"{spec}'s config")[1]
        except ConfigKeyError:
            pass
    return ModelSource(f"--module {spec}", params.numel, params, shape, notes=tuple(notes))


def _hf_config(parser, spec):
    """The config dict of --model: a config.json's, else a known model's."""
    if not os.path.exists(spec) and known_model(spec) is not None:
        return known_model(spec)
    try:
        return read_config(spec)
    except ConfigKeyError as e:
        known = "" if os.path.exists(spec) else f" (the known models: {', '.join(KNOWN_MODELS)})"
        parser.error(f"argument --model: {e}{known}")


def _base_source(parser, args, unit_classes):
    given = [args.hidden, args.layers, args.heads]
    shape = None
    if args.hidden or args.heads:  # --layers alone is enough for stage-3 units
        if not all(given):
            parser.error("arguments --hidden, --layers and --heads go together (activations need all three)")
        shape = TransformerShape(args.hidden, args.layers, args.heads, args.vocab or 0)
    if args.params is not None:
        notes = ("model states without the padding of each buffer (at most 16 x cards elements under per bucket)",)
        return ModelSource("--params", args.params, shape=shape, layers=args.layers, notes=notes)
    if args.module is not None:
        source = _module_source(parser, args.module, unit_classes)
        return source if shape is None else dataclasses.replace(source, shape=shape)
    try:
        params, hf_shape, notes = model_params(_hf_config(parser, args.model), args.model)
    except ConfigKeyError as e:
        parser.error(f"argument --model: {e}")
    return ModelSource(f"--model {args.model}", params.numel, params, shape or hf_shape, notes=tuple(notes))


def _frozen_source(parser, args, source):
    """The source with the parameters --lora-rank or --trainable-fraction freeze."""
    if args.lora_targets is not None and args.lora_rank is None:
        parser.error("argument --lora-targets: goes with --lora-rank")
    if args.lora_rank is None and args.trainable_fraction is None:
        return source
    flag = "--lora-rank" if args.lora_rank is not None else "--trainable-fraction"
    if source.params is None:
        if args.lora_rank is not None:
            parser.error("argument --lora-rank: a bare --params count has no layers to give adapters: use --model "
                         f"config.json (or a known model: {', '.join(KNOWN_MODELS)}) or --module, or "
                         "--trainable-fraction for an estimate")
        frozen = source.numel - trained_count(source.numel, args.trainable_fraction)
        note = f"--trainable-fraction {args.trainable_fraction:g}: the rest frozen in {args.dtype}"
        return dataclasses.replace(source, frozen_numel=frozen, notes=source.notes + (note,))
    try:
        check_unfrozen(source.params, flag)
    except ValueError as e:
        parser.error(f"argument {flag}: {e}")
    if args.lora_rank is not None:
        targets = args.lora_targets or DEFAULT_TARGETS
        try:
            lora_targets(source.params, targets)
        except ValueError as e:
            parser.error(f"argument --lora-targets: {e}")
        params = with_lora(source.params, args.lora_rank, targets, args.dtype)
        note = f"LoRA r={args.lora_rank} on {', '.join(targets)} (peft's parameters), the base frozen in {args.dtype}"
    else:
        params = with_trainable_fraction(source.params, args.trainable_fraction, args.dtype)
        note = (f"--trainable-fraction {args.trainable_fraction:g}: the last parameters (the head, the top "
                f"layers) trained, the rest frozen in {args.dtype}")
    return dataclasses.replace(source, numel=params.numel, params=params, notes=source.notes + (note,))


def model_source(parser, args, unit_classes=()):
    return _frozen_source(parser, args, _base_source(parser, args, unit_classes))


def _engine_config(parser, args):
    config = {}
    if args.config:
        try:
            with open(args.config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"argument --config: cannot read {args.config}: {e}")
    if args.grad_accum:
        config = {**config, "gradient_accumulation_steps": args.grad_accum}
        config.pop("train_batch_size", None)
    return config


def plan(args, parser):
    """[{"gpus", "gpu_memory", "cards"}] for every card count and memory asked, each setup's
    Card in order; and the link."""
    link = None
    if args.link is not None:
        try:
            link = parse_link(args.link)
        except ValueError as e:
            parser.error(f"argument --link: {e}")
    for gpus in args.gpus:
        if args.shard_group and not (1 < args.shard_group < gpus and gpus % args.shard_group == 0):
            parser.error(f"argument --shard-group: {args.shard_group} must divide --gpus {gpus} and lie between "
                         f"2 and {gpus // 2} (a shard group of 1 or of every card is no hybrid)")
    config = _engine_config(parser, args)
    try:
        import zeroshard

        unit_classes = tuple(zeroshard.Config.from_dict(config).zeroshard.stage3_unit_classes)
        model = model_source(parser, args, unit_classes)
        plans = []
        for gpus in args.gpus:
            cards = [card(s, model, gpus, args.dtype, config, args.seq, args.micro_batch,
                          args.activation_checkpointing, link and link[0])
                     for s in setups(gpus, args.shard_group, args.offload)]
            plans += [{"gpus": gpus, "gpu_memory": m, "cards": ordered(cards)} for m in args.gpu_memory]
    except ValueError as e:  # the engine's config reader: names the key path
        parser.error(f"argument --config: {e}")
    return model, plans, link


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    model, plans, link = plan(args, parser)
    if args.json:
        json.dump(json_report(model, args.dtype, args, plans, link), sys.stdout, indent=1)
        print()
    else:
        print(text_report(model, args.dtype, args, plans, link))
    return 0
