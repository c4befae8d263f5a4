"""zeroshard.hf.config: a zero_config filled from TrainingArguments (docs/hf.md).

Held to: every "auto" the Trainer owns takes its argument's value; an absent Trainer-owned key
is filled too, but optimizer / scheduler sections (and an fp16/bf16 section only to say false)
are never created; every disagreement between a written value and an argument is listed in one
error that names both sides; arguments zeroshard cannot honour are refused by name; the input is
never changed; and what comes out is a config zeroshard.Config reads.
"""

import copy
import json

import pytest

transformers = pytest.importorskip("transformers")

import zeroshard  # noqa: E402
from zeroshard.hf.config import (ADAMW_OPTIMS, adamw_from_args, trainer_config,  # noqa: E402
                                 uses_trainer_scheduler)

AUTO_EVERYTHING = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "steps_per_print": 7,
}


def make_args(tmp_path, **kw):
    kw.setdefault("report_to", "none")
    kw.setdefault("use_cpu", True)  # bf16=True is refused on a machine without a bf16 GPU otherwise
    return transformers.TrainingArguments(output_dir=str(tmp_path), **kw)


class TwoRankArgs(transformers.TrainingArguments):
    """TrainingArguments as on 2 ranks, without a process group."""

    @property
    def world_size(self):
        return 2


ARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, max_grad_norm=0.5, learning_rate=2e-4,
            adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1, warmup_steps=10, bf16=True)


def test_every_auto_key_takes_its_argument(tmp_path):
    args = make_args(tmp_path, **ARGS)
    cfg = trainer_config(AUTO_EVERYTHING, args, num_training_steps=100)
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_batch_size"] == 12
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["fp16"] == {"enabled": False} and cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 10,
                                          "total_num_steps": 100}
    # The hidden-size keys are zeroshard.initialize's to resolve, from the model.
    assert cfg["zero_optimization"] == AUTO_EVERYTHING["zero_optimization"]
    assert cfg["steps_per_print"] == 7


def test_warmup_is_at_least_one_step_and_follows_a_fractional_warmup(tmp_path):
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    assert trainer_config(sched, make_args(tmp_path), 50)["scheduler"]["params"]["warmup_num_steps"] == 1
    fraction = make_args(tmp_path, warmup_steps=0.1)
    assert trainer_config(sched, fraction, 95)["scheduler"]["params"]["warmup_num_steps"] == 10


def test_train_batch_size_counts_the_world(tmp_path):
    args = TwoRankArgs(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4,
                       gradient_accumulation_steps=3)
    assert args.world_size == 2
    assert trainer_config({"train_batch_size": "auto"}, args, 10)["train_batch_size"] == 24
    assert trainer_config({}, args, 10)["train_batch_size"] == 24
    with pytest.raises(ValueError, match=r"train_batch_size=12 in the zero_config.*= 2 \* 4 \* 3 = 24"):
        trainer_config({"train_batch_size": 12}, args, 10)


def test_absent_trainer_keys_are_filled_and_sections_are_not_created(tmp_path):
    args = make_args(tmp_path, **ARGS)
    cfg = trainer_config({"zero_optimization": {"stage": 3}}, args, 100)
    assert cfg == {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": 3, "train_batch_size": 12, "gradient_clipping": 0.5,
                   "bf16": {"enabled": True}}
    # Half precision off: no section is added only to say false.
    cfg = trainer_config({}, make_args(tmp_path), 100)
    assert "fp16" not in cfg and "bf16" not in cfg and "optimizer" not in cfg and "scheduler" not in cfg
    assert cfg["gradient_clipping"] == 1.0
    cfg = trainer_config({"fp16": {"loss_scale": 0}}, make_args(tmp_path, fp16=True, use_cpu=False), 100)
    assert cfg["fp16"] == {"loss_scale": 0, "enabled": True}


def test_existing_sections_get_their_absent_params(tmp_path):
    args = make_args(tmp_path, **ARGS)
    cfg = trainer_config({"optimizer": {"type": "AdamW"},
                          "scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}}}, args, 100)
    assert cfg["optimizer"]["params"] == adamw_from_args(args)
    # Only the keys WarmupCosineLR reads: warmup_min_lr / warmup_max_lr would be unknown keys to it.
    assert cfg["scheduler"]["params"] == {"cos_min_ratio": 0.1, "total_num_steps": 100, "warmup_num_steps": 10}
    one_cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-4}}
    assert trainer_config({"scheduler": one_cycle}, args, 100)["scheduler"] == one_cycle


def test_mismatches_are_collected_into_one_error(tmp_path):
    args = make_args(tmp_path, max_grad_norm=1.0, per_device_train_batch_size=8, learning_rate=3e-5)
    written = {"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
               "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 7, "warmup_min_lr": 1e-6}},
               "bf16": {"enabled": True}}
    with pytest.raises(ValueError) as e:
        trainer_config(written, args, 100)
    msg = str(e.value)
    for line in ("gradient_clipping=0.5 in the zero_config, but TrainingArguments max_grad_norm=1.0",
                 "train_micro_batch_size_per_gpu=2 in the zero_config, but TrainingArguments "
                 "per_device_train_batch_size=8",
                 "optimizer.params.lr=0.001 in the zero_config, but TrainingArguments learning_rate=3e-05",
                 "optimizer.params.betas=[0.9, 0.95] in the zero_config, but TrainingArguments "
                 "[adam_beta1, adam_beta2]=[0.9, 0.999]",
                 "scheduler.params.total_num_steps=7 in the zero_config, but the Trainer's num_training_steps=100",
                 "bf16.enabled=true in the zero_config, but TrainingArguments bf16=False"):
        assert line in msg
    assert "warmup_min_lr" not in msg  # no argument owns it: filled only, never a disagreement
    assert '"auto"' in msg and "drop the key" in msg and "change the argument" in msg


def test_numbers_compare_as_numbers(tmp_path):
    args = make_args(tmp_path, max_grad_norm=1.0, per_device_train_batch_size=2, weight_decay=0.0)
    written = {"gradient_clipping": 1, "train_micro_batch_size_per_gpu": 2.0, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"betas": (0.9, 0.999), "weight_decay": 0,
                                                         "lr": 5e-5, "eps": 1e-8}}}
    cfg = trainer_config(written, args, 10)
    assert cfg["gradient_clipping"] == 1 and cfg["optimizer"]["params"]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="fp16.enabled=1"):  # a bool is not a number
        trainer_config({"fp16": {"enabled": 1}}, make_args(tmp_path, fp16=True), 10)


def test_no_clipping_argument_is_clipping_off(tmp_path):
    assert trainer_config({}, make_args(tmp_path, max_grad_norm=0.0), 10)["gradient_clipping"] == 0.0
    assert trainer_config({"gradient_clipping": 0}, make_args(tmp_path, max_grad_norm=None), 10)


def test_bfloat16_alias_is_the_bf16_section(tmp_path):
    args = make_args(tmp_path, bf16=True)
    cfg = trainer_config({"bfloat16": {"enabled": "auto"}}, args, 10)
    assert cfg["bfloat16"] == {"enabled": True} and "bf16" not in cfg
    assert trainer_config({"bfloat16": {}}, args, 10)["bfloat16"] == {"enabled": True}
    with pytest.raises(ValueError, match=r"bfloat16.enabled=false in the zero_config, but TrainingArguments bf16=True"):
        trainer_config({"bfloat16": {"enabled": False}}, args, 10)
    assert zeroshard.Config.from_dict(cfg).bf16


@pytest.mark.parametrize("setting, named", [
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "leave deepspeed unset; pass the config as zero_config="),
    ({"fsdp": True}, "fsdp=True is set"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True is not supported"),
])
def test_arguments_zeroshard_cannot_honour_are_refused(tmp_path, setting, named):
    args = make_args(tmp_path)
    for name, value in setting.items():
        setattr(args, name, value)  # set after construction: deepspeed / fsdp would start their own set-up
    with pytest.raises(ValueError, match="TrainingArguments " + list(setting)[0]) as e:
        trainer_config({}, args, 10)
    assert named in str(e.value)


@pytest.mark.parametrize("optim", ["adafactor", "sgd", "adamw_8bit", "lomo", "adamw_torch_xla", "stable_adamw"])
def test_an_optimizer_other_than_adamw_is_refused_without_an_optimizer_section(tmp_path, optim):
    args = make_args(tmp_path)
    args.optim = transformers.training_args.OptimizerNames(optim)
    with pytest.raises(ValueError, match=f"optim='{optim}'") as e:
        trainer_config({}, args, 10)
    assert all(repr(name) in str(e.value) for name in ADAMW_OPTIMS)
    # An optimizer section replaces the Trainer's optimizer, as in HF's DeepSpeed integration.
    assert trainer_config({"optimizer": {"type": "AdamW"}}, args, 10)["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("optim", ADAMW_OPTIMS)
def test_torch_adamw_names_are_accepted(tmp_path, optim):
    cfg = trainer_config({}, make_args(tmp_path, optim=optim), 10)
    assert "optimizer" not in cfg and uses_trainer_scheduler(cfg)


def test_optim_args_are_refused_without_an_optimizer_section(tmp_path):
    args = make_args(tmp_path, optim_args="amsgrad=True")
    with pytest.raises(ValueError, match="optim_args='amsgrad=True' cannot be honoured"):
        trainer_config({}, args, 10)
    trainer_config({"optimizer": {"type": "AdamW"}}, args, 10)


def test_path_and_dict_give_the_same_config_and_the_dict_is_not_changed(tmp_path):
    args = make_args(tmp_path, **ARGS)
    given = copy.deepcopy(AUTO_EVERYTHING)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(given))
    from_dict = trainer_config(given, args, 100)
    assert given == AUTO_EVERYTHING
    assert trainer_config(path, args, 100) == from_dict == trainer_config(str(path), args, 100)
    from_dict["optimizer"]["params"]["lr"] = 1.0  # the result shares nothing with the input
    assert given["optimizer"]["params"]["lr"] == "auto"


def test_unreadable_configs_are_errors_naming_the_path(tmp_path):
    args = make_args(tmp_path)
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=f"zero_config '{missing}' cannot be read"):
        trainer_config(missing, args, 10)
    bad = tmp_path / "bad.json"
    bad.write_text("{\"zero_optimization\": {\"stage\": 3,}}")
    with pytest.raises(ValueError, match=f"zero_config '{bad}' is not JSON"):
        trainer_config(bad, args, 10)
    twice = tmp_path / "twice.json"
    twice.write_text("{\"gradient_clipping\": 1.0, \"gradient_clipping\": 0.5}")
    with pytest.raises(ValueError, match=f"zero_config '{twice}' has the key 'gradient_clipping' twice"):
        trainer_config(twice, args, 10)
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(ValueError, match="holds a JSON list"):
        trainer_config(listed, args, 10)
    with pytest.raises(TypeError, match="not int"):
        trainer_config(3, args, 10)


@pytest.mark.parametrize("written", [AUTO_EVERYTHING, {"zero_optimization": {"stage": 2}},
                                     {"scheduler": {"type": "WarmupLR"}, "bfloat16": {}}])
def test_filled_config_is_read_by_zeroshard(tmp_path, written):
    args = make_args(tmp_path, **ARGS)
    cfg = zeroshard.Config.from_dict(trainer_config(written, args, 100))
    assert cfg.batch_sizes(1) == {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4,
                                  "gradient_accumulation_steps": 3}
    assert cfg.bf16
    assert set(cfg.auto_keys) <= {"zero_optimization.reduce_bucket_size",
                                  "zero_optimization.stage3_prefetch_bucket_size",
                                  "zero_optimization.stage3_param_persistence_threshold"}


def test_adamw_from_args_and_uses_trainer_scheduler(tmp_path):
    args = make_args(tmp_path, **ARGS)
    assert adamw_from_args(args) == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert uses_trainer_scheduler({"optimizer": {}})
    assert not uses_trainer_scheduler({"scheduler": {"type": "WarmupLR"}})


def test_unknown_steps_leave_the_schedule_step_counts_as_written(tmp_path):
    """The Trainer checks its config when it is built, before the steps are known: a written
    total_num_steps is checked at train(), not against a placeholder."""
    written = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 5}}}
    cfg = trainer_config(written, make_args(tmp_path), None)
    assert cfg["scheduler"]["params"]["total_num_steps"] == 1000
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 5
    with pytest.raises(ValueError, match="total_num_steps=1000 in the zero_config"):
        trainer_config(written, make_args(tmp_path), 20)


@pytest.mark.parametrize("argument, value, says", [
    ("fp16_full_eval", True, "its own compute dtype"), ("bf16_full_eval", True, "its own compute dtype"),
    ("torch_compile", True, "not supported yet"), ("lr_scheduler_type", "reduce_lr_on_plateau", "evaluation metrics"),
    ("lr_scheduler_type", "greedy", "evaluation metrics")])
def test_arguments_the_engine_cannot_honour_are_refused(tmp_path, argument, value, says):
    evaluated = {"eval_strategy": "steps"} if argument == "lr_scheduler_type" else {}  # the plateau ones need it
    with pytest.raises(ValueError, match=f"TrainingArguments {argument}=.*{says}"):
        trainer_config({}, make_args(tmp_path, **{argument: value}, **evaluated), 10)


def test_a_scheduler_section_replaces_a_plateau_schedule(tmp_path):
    args = make_args(tmp_path, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps")
    assert trainer_config({"scheduler": {"type": "WarmupLR"}}, args, 10)["scheduler"]["type"] == "WarmupLR"
