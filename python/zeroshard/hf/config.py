"""The Trainer's zero_config, filled from its TrainingArguments (docs/hf.md).

The rules are those of Hugging Face's DeepSpeed integration (HfTrainerDeepSpeedConfig's
trainer_config_process / _finalize): "auto" takes the argument's value, a written value that
differs from the argument is an error. One difference: an absent Trainer-owned key is filled
too, so a config of only {"zero_optimization": {"stage": 3}} trains as the arguments say
instead of with DeepSpeed's defaults (in HF a missing gradient_clipping means no clipping,
whatever max_grad_norm says).
"""

import copy
import json
import os

# Trainer `optim` names whose update is torch.optim.AdamW's, which the engine's fused AdamW
# computes. adamw_torch_xla / adamw_torch_npu_fused are AdamW too, but they name kernels for XLA
# and Ascend devices, where zeroshard does not run; adamw_anyprecision exists to keep the states
# in other dtypes (its optim_args), which the engine's fp32 states would silently not honour.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")

# The filled keys each DeepSpeed schedule reads (config_keys.cpp); an absent one is filled only
# when the schedule reads it, since any other is an unknown key.
_SCHEDULE_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"),
    "WarmupCosineLR": ("total_num_steps", "warmup_num_steps"),
}


def adamw_from_args(args):
    """The Trainer's AdamW hyper-parameters, for a config without an optimizer section."""
    return {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2],
            "eps": args.adam_epsilon, "weight_decay": args.weight_decay}


def uses_trainer_scheduler(config_dict):
    """True when the config has no scheduler section: the Trainer's own schedule (lr_scheduler_type) runs."""
    return "scheduler" not in config_dict


def trainer_config(zero_config, args, num_training_steps):
    """A new config dict: zero_config (a JSON path or a dict, never changed) with the
    Trainer-owned keys filled from args. num_training_steps None (not known yet) leaves the
    schedule's step counts as written. Raises ValueError for arguments zeroshard cannot honour
    and, in one error, for every value the config and the arguments disagree on."""
    _check_args(args)
    config, source = _load(zero_config)
    if "optimizer" not in config:
        _check_trainer_optimizer(args)
    if "scheduler" not in config:
        _check_trainer_schedule(args)
    mismatches = []

    def fill(path, value, says, absent=True, match=True):
        """Put value at path when written "auto" (or absent, when `absent`); otherwise, unless
        `match` is off, a written value that is not `value` is a mismatch."""
        *parents, key = path.split(".")
        node = config
        for name in parents:
            if node.get(name) is None and absent:
                node[name] = {}
            node = node.get(name)
            if not isinstance(node, dict):
                return  # absent, or not an object: Config.from_dict names what is wrong with it
        written = node.get(key)
        if written == "auto" or (written is None and absent):
            node[key] = value
        elif written is not None and match and not _same(written, value):
            mismatches.append(f"{path}={json.dumps(written)} in the zero_config, but {says}")

    micro, accumulation, world = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    fill("train_micro_batch_size_per_gpu", micro, f"TrainingArguments per_device_train_batch_size={micro}")
    fill("gradient_accumulation_steps", accumulation, f"TrainingArguments gradient_accumulation_steps={accumulation}")
    fill("train_batch_size", world * micro * accumulation,
         f"TrainingArguments world_size * per_device_train_batch_size * gradient_accumulation_steps = "
         f"{world} * {micro} * {accumulation} = {world * micro * accumulation}")
    # The Trainer clips only when max_grad_norm is > 0; None or 0 is the config's 0, clipping off.
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0
    fill("gradient_clipping", clip, f"TrainingArguments max_grad_norm={args.max_grad_norm}")

    # A section is added only to turn half precision on: an absent one already means off.
    fp16, bf16 = bool(args.fp16), bool(args.bf16)  # the *_full_eval ones are refused (_check_args)
    bf16_name = "bfloat16" if "bfloat16" in config and "bf16" not in config else "bf16"
    fill("fp16.enabled", fp16, f"TrainingArguments fp16={fp16}", absent=fp16)
    fill(f"{bf16_name}.enabled", bf16, f"TrainingArguments bf16={bf16}", absent=bf16)

    # Sections are never created here: without one the Trainer's AdamW / schedule runs (the caller's).
    if isinstance(config.get("optimizer"), dict):
        adamw = adamw_from_args(args)
        fill("optimizer.params.lr", adamw["lr"], f"TrainingArguments learning_rate={args.learning_rate}")
        fill("optimizer.params.betas", adamw["betas"],
             f"TrainingArguments [adam_beta1, adam_beta2]=[{args.adam_beta1}, {args.adam_beta2}]")
        fill("optimizer.params.eps", adamw["eps"], f"TrainingArguments adam_epsilon={args.adam_epsilon}")
        fill("optimizer.params.weight_decay", adamw["weight_decay"],
             f"TrainingArguments weight_decay={args.weight_decay}")
    if isinstance(config.get("scheduler"), dict):
        reads = _SCHEDULE_KEYS.get(config["scheduler"].get("type"), ())
        # warmup_min_lr is no argument: 0 is the Trainer's schedules' start, never a disagreement.
        fill("scheduler.params.warmup_min_lr", 0, "", absent="warmup_min_lr" in reads, match=False)
        fill("scheduler.params.warmup_max_lr", args.learning_rate,
             f"TrainingArguments learning_rate={args.learning_rate}", absent="warmup_max_lr" in reads)
    if isinstance(config.get("scheduler"), dict) and num_training_steps is not None:
        warmup = args.get_warmup_steps(num_training_steps)
        fill("scheduler.params.total_num_steps", num_training_steps,
             f"the Trainer's num_training_steps={num_training_steps} (from max_steps, or num_train_epochs "
             "and the dataset)", absent="total_num_steps" in reads)
        # DeepSpeed refuses 0 warm-up steps (HF keeps it at 1 for the same reason).
        fill("scheduler.params.warmup_num_steps", max(1, warmup),
             f"TrainingArguments warmup_steps={args.warmup_steps} gives max(1, {warmup}) = {max(1, warmup)}",
             absent="warmup_num_steps" in reads)

    if mismatches:
        listed = "\n".join(f"  - {m}" for m in mismatches)
        raise ValueError(
            f"zeroshard.hf.Trainer: the zero_config ({source}) disagrees with the TrainingArguments:\n{listed}\n"
            "For each key: write \"auto\" in the zero_config (the argument fills it), or drop the key (it is "
            "filled from the argument too), or change the argument to the config's value.")
    return config


def _same(written, value):
    """Numbers as numbers (1 == 1.0), betas element by element, a bool only as a bool."""
    if isinstance(value, list):
        return (isinstance(written, (list, tuple)) and len(written) == len(value)
                and all(_same(w, v) for w, v in zip(written, value)))
    if isinstance(value, bool) or isinstance(written, bool):
        return type(written) is type(value) and written == value
    if isinstance(written, (int, float)) and isinstance(value, (int, float)):
        return written == value
    return False


def _check_args(args):
    where = "zeroshard.hf.Trainer: TrainingArguments"
    if args.deepspeed:
        raise ValueError(f"{where} deepspeed={args.deepspeed!r} is set, but the Trainer runs on zeroshard: leave "
                         "deepspeed unset; pass the config as zero_config= (a JSON path or a dict)")
    if args.fsdp:
        raise ValueError(f"{where} fsdp={args.fsdp!r} is set, but zeroshard does the sharding: leave fsdp unset "
                         "(zero_optimization.stage 3 in the zero_config shards parameters as FSDP does)")
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name, False):
            raise ValueError(f"{where} {name}=True is not supported: the engine evaluates in its own compute dtype "
                             "(the zero_config's bf16 / fp16 sections, filled from bf16 / fp16); leave it False")
    if getattr(args, "torch_compile", False):
        raise ValueError(f"{where} torch_compile=True is not supported yet: the Trainer would compile the model "
                         "around zeroshard's hooks; leave it False")
    if args.n_gpu > 1:
        raise ValueError(f"{where} n_gpu={args.n_gpu}: the Trainer would wrap the model in torch.nn.DataParallel "
                         "over every visible GPU of one process; launch one process per GPU with torchrun instead")
    if args.auto_find_batch_size:
        raise ValueError(f"{where} auto_find_batch_size=True is not supported: the engine is built with fixed "
                         "batch sizes; set per_device_train_batch_size to a size that fits and leave "
                         "auto_find_batch_size False")


def _check_trainer_optimizer(args):
    """Without an optimizer section the Trainer's optimizer is the one to run, as zeroshard's AdamW."""
    where = "zeroshard.hf.Trainer: TrainingArguments"
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_OPTIMS:
        accepted = ", ".join(repr(name) for name in ADAMW_OPTIMS)
        raise ValueError(f"{where} optim={optim!r} cannot run: the zero_config has no optimizer section, so the "
                         f"Trainer's optimizer is used, and zeroshard runs AdamW only. Set optim to one of "
                         f"{accepted}, or add an optimizer section ({{\"type\": \"AdamW\", ...}}) to the zero_config")
    if args.optim_args:
        raise ValueError(f"{where} optim_args={args.optim_args!r} cannot be honoured: zeroshard's AdamW takes only "
                         "learning_rate, adam_beta1, adam_beta2, adam_epsilon and weight_decay; leave optim_args "
                         "unset, or write the optimizer's params in an optimizer section of the zero_config")


def _check_trainer_schedule(args):
    """Without a scheduler section the Trainer's schedule runs, stepped by the engine after each
    optimizer step: one that steps on evaluation metrics cannot be."""
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if schedule in ("reduce_lr_on_plateau", "greedy"):
        raise ValueError(f"zeroshard.hf.Trainer: TrainingArguments lr_scheduler_type={schedule!r} steps on evaluation "
                         "metrics, but the engine steps the schedule after every optimizer step; use a schedule of "
                         "the steps (linear, cosine, constant_with_warmup, ...) or a scheduler section in the "
                         "zero_config")


class _DuplicateKey(Exception):
    pass


def _refuse_duplicates(pairs):
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _DuplicateKey(key)  # json.load would keep the last one without a word
    return dict(pairs)


def _load(zero_config):
    """(a config dict of our own, its name for messages)."""
    if isinstance(zero_config, dict):
        return copy.deepcopy(zero_config), "<dict>"
    if not isinstance(zero_config, (str, os.PathLike)):
        raise TypeError("zeroshard.hf.Trainer: zero_config must be the path of a JSON config or a dict, "
                        f"not {type(zero_config).__name__}")
    path = os.fspath(zero_config)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f, object_pairs_hook=_refuse_duplicates)
    except OSError as e:
        raise ValueError(f"zeroshard.hf.Trainer: zero_config {path!r} cannot be read: {e.strerror}; pass the "
                         "path of a DeepSpeed-style JSON config, or a dict") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"zeroshard.hf.Trainer: zero_config {path!r} is not JSON: {e}") from None
    except _DuplicateKey as e:
        raise ValueError(f"zeroshard.hf.Trainer: zero_config {path!r} has the key {e.args[0]!r} twice in one "
                         "object; keep one") from None
    if not isinstance(config, dict):
        raise ValueError(f"zeroshard.hf.Trainer: zero_config {path!r} holds a JSON {type(config).__name__}, "
                         "not an object of config keys")
    return config, path
