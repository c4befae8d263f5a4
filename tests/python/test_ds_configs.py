"""DeepSpeed users' configs as they are: the files in ds_configs/ are written in the styles found
in the wild (the Hugging Face Trainer's templates with "auto", a fine-tuning project's ZeRO-3
file without an optimizer section, DeepSpeed's own examples, comment keys and monitors, old key
names, offload device "none" and "cpu"); each loads, its "auto" keys resolve the way the Trainer fills
them, and it trains at 2 ranks. Also: the "auto" rules through initialize, and torch schedulers
through engine.optimizer. The spawned cases share one run per world size (spawn.SharedRuns),
each with its own result and failure."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from models import global_batch, make_model
from spawn import SharedRuns
from training import AdamWReference, engine_config, train_global_batches

import zeroshard

CONFIGS = Path(__file__).resolve().parent / "ds_configs"

# What the Hugging Face Trainer fills for its "auto" keys (trainer_config_process): from
# TrainingArguments here, per_device_train_batch_size=2, learning_rate=1e-3, ...
TRAINER = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 1e-3,
    "scheduler.params.warmup_num_steps": 2,
    "scheduler.params.total_num_steps": 6,
}

# Each file: its stage, and the keys it warns about (DeepSpeed keys zeroshard does not implement,
# and top-level keys DeepSpeed ignores).
EXPECTED = {
    "hf_zero2.json": (2, []),
    "hf_zero3.json": (3, ["zero_optimization.sub_group_size", "zero_optimization.stage3_max_reuse_distance"]),
    # The Trainer's ZeRO-3 template as its documentation shows it, with both offloads to "cpu".
    "hf_zero3_offload.json": (3, ["zero_optimization.sub_group_size", "zero_optimization.stage3_max_reuse_distance"]),
    "finetune_z3_bf16.json": (3, ["zero_allow_untested_optimizer", "zero_optimization.sub_group_size",
                                  "zero_optimization.stage3_max_reuse_distance"]),
    "ds_example_cifar.json": (1, ["prescale_gradients", "fp16.fp16_master_weights_and_grads",
                                  "zero_optimization.cpu_offload"]),
    "comments_and_monitors.json": (1, ["_comment", "_author", "comms_config", "monitor_config", "tensorboard"]),
    "onecycle_tutorial.json": (2, []),
    "fp16_range_test_old_keys.json": (3, ["fp16.auto_cast"]),
}


SCHEDULERS = [(2, "lambda"), (3, "lambda"), (3, "hf")]  # (stage, kind) of the torch scheduler cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {"corpus": (_run_corpus,), "initialize_errors": (_initialize_errors,)}
    for stage, kind in SCHEDULERS:
        if kind != "hf" or importlib.util.find_spec("transformers") is not None:  # else the case skips
            cases[f"schedulers_stage{stage}_{kind}"] = (_torch_schedulers, stage, kind)
    cases["scheduler_checkpoint"] = (_scheduler_checkpoint, str(tmp_path_factory.mktemp("scheduler_checkpoint")))
    return SharedRuns({1: {"replaced": (_replaced,)}, 2: cases})


def _load(name):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zeroshard.Config.from_file(str(CONFIGS / name))


def test_the_corpus_is_what_the_test_lists():
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_config_loads_with_its_autos_recorded_and_its_warnings(name):
    stage, warned = EXPECTED[name]
    cfg = _load(name)
    assert cfg.stage == stage
    written = json.loads((CONFIGS / name).read_text())
    autos = [p for p in _paths(written) if _at(written, p) == "auto"]
    assert sorted(cfg.auto_keys) == sorted(autos)
    for key in warned:
        assert any(f'"{key}"' in w for w in cfg.warnings), (key, cfg.warnings)
    assert len(cfg.warnings) == len(warned), cfg.warnings


def _paths(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from _paths(value, path + ".")


def _at(tree, path):
    for part in path.split("."):
        tree = tree[part]
    return tree


def _run_corpus(rank, world_size):
    out = {}
    for name in sorted(EXPECTED):
        cfg = _load(name)
        model = make_model()
        engine = zeroshard.initialize(model, cfg, auto={k: v for k, v in TRAINER.items() if k in cfg.auto_keys})
        losses = train_global_batches(model, engine, rank, world_size, range(3),
                                      micro=engine.train_micro_batch_size_per_gpu)
        out[name] = (engine.config.auto_keys, engine.global_steps, losses,
                     engine.config.zero_optimization.reduce_bucket_size, engine.config.stage,
                     engine.memory_stats()["host_total"])
    return out


def test_every_config_trains_at_two_ranks_after_the_trainers_fill(runs):
    results = runs.result(2, "corpus")
    h = 24  # make_model's width: the hidden size read from the weights
    for name, (autos, steps, losses, reduce_bucket, stage, host) in results[0].items():
        assert autos == [], name
        assert (host > 0) == ("offload" in name), (name, host)
        assert steps == 3, name
        assert all(math.isfinite(x) for x in losses), (name, losses)
        if "zero_optimization.reduce_bucket_size" in _load(name).auto_keys:
            assert reduce_bucket == h * h, name
    assert results[0] == results[1]
    # Offload changes where the state lives, not the numbers.
    assert results[0]["hf_zero3_offload.json"][2] == results[0]["hf_zero3.json"][2]


def _initialize_errors(rank, world_size):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep()
    logging.getLogger("zeroshard").addHandler(keep)
    try:
        return _initialize_errors_logged(records)
    finally:  # the next cases of the shared run log as usual
        logging.getLogger("zeroshard").removeHandler(keep)


def _initialize_errors_logged(records):
    errors = []
    for auto in ({}, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}):
        try:
            zeroshard.initialize(make_model(), str(CONFIGS / "hf_zero3.json"), auto=auto)
        except ValueError as e:
            errors.append(str(e))

    class Config:  # a Hugging Face model config: its hidden size wins over the weights
        hidden_size = 10

    model = make_model()
    model.config = Config()
    engine = zeroshard.initialize(model, str(CONFIGS / "hf_zero3.json"),
                                  auto={k: v for k, v in TRAINER.items() if k != "gradient_accumulation_steps"})
    z = engine.config.zero_optimization
    return errors, records, (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold)


def test_initialize_names_every_open_auto_and_logs_what_each_became(runs):
    (errors, records, sizes), (_, other_records, _) = runs.result(2, "initialize_errors")
    assert len(errors) == 2
    assert '"optimizer.params.lr"' in errors[0] and '"train_micro_batch_size_per_gpu"' in errors[0]
    assert 'auto={"gradient_clipping": ...' in errors[0]
    assert '"gradient_clipping"' not in errors[1] and '"scheduler.params.total_num_steps"' in errors[1]
    assert sizes == (100, 90, 100)  # h*h, int(0.9*h*h), 10*h with h = model.config.hidden_size = 10
    [line] = records
    assert '"auto" resolved: ' in line and "gradient_accumulation_steps=1 (batch rule)" in line
    assert "the hidden size from model.config.hidden_size" in line
    assert other_records == []  # rank 0 only


def _schedule(kind):
    """A scheduler factory of an optimizer: a torch LambdaLR warm-up, or the Hugging Face helper."""
    if kind == "hf":
        from transformers import get_linear_schedule_with_warmup

        return lambda opt: get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _torch_schedulers(rank, world_size, stage, kind):
    model = make_model()
    engine = zeroshard.initialize(model, engine_config(stage, gas=2), lr_scheduler=_schedule(kind))
    lrs = []
    train_global_batches(model, engine, rank, world_size, range(4),
                         after_step=lambda: lrs.append(engine.get_lr()))
    state = {k: v for k, v in engine.full_state_dict().items()}
    return lrs, state


@pytest.mark.parametrize("stage,kind", SCHEDULERS)
def test_a_torch_scheduler_of_engine_optimizer_sets_each_steps_lr(runs, stage, kind):
    """A torch scheduler (or the Hugging Face get_linear_schedule_with_warmup helper) built on
    engine.optimizer: the engine uses the lr it sets at every step, as torch.optim.AdamW does."""
    if kind == "hf":
        pytest.importorskip("transformers")
    results = runs.result(2, f"schedulers_stage{stage}_{kind}")
    model = make_model()
    reference = AdamWReference(model)
    sched = _schedule(kind)(reference.optimizer)
    expected_lrs = []
    for step in range(4):
        reference.step(global_batch(step, 2 * 2 * 2))
        sched.step()
        expected_lrs.append(reference.optimizer.param_groups[0]["lr"])
    for lrs, state in results:
        assert lrs == expected_lrs
        for name, ref in model.state_dict().items():
            torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-5)


def _scheduler_checkpoint(rank, world_size, tmp):
    from torch.optim.lr_scheduler import LambdaLR

    def make():
        model = make_model()
        return model, zeroshard.initialize(model, engine_config(2), lr_scheduler=lambda o: LambdaLR(o, lambda s: 0.5 ** s))

    model, engine = make()
    train_global_batches(model, engine, rank, world_size, range(2))
    engine.save_checkpoint(tmp, client_state={"epoch": 3})
    train_global_batches(model, engine, rank, world_size, range(2, 4))
    uninterrupted = (engine.get_lr(), engine.full_state_dict())
    model, engine = make()
    _, client = engine.load_checkpoint(tmp)
    after_load = engine.get_lr()
    train_global_batches(model, engine, rank, world_size, range(2, 4))
    return uninterrupted, (engine.get_lr(), engine.full_state_dict()), client, after_load, engine.lr_scheduler.last_epoch


def test_a_client_scheduler_is_checkpointed_and_resumes_exactly(runs):
    for (lr, state), (lr2, state2), client, after_load, last_epoch in runs.result(2, "scheduler_checkpoint"):
        assert client == {"epoch": 3}
        assert after_load == 0.25 * 1e-2  # two steps into 0.5 ** s
        assert (lr2, last_epoch) == (lr, 4)
        for name in state:
            assert torch.equal(state[name], state2[name]), name


def test_a_client_scheduler_replaces_the_configs_with_a_warning(runs):
    assert runs.result(1, "replaced")[0]


def _replaced(rank, world_size):
    import warnings

    cfg = engine_config(2) | {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zeroshard.initialize(make_model(), cfg,
                                      lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))
    assert not engine.config.scheduler.enabled
    return any("scheduler (WarmupLR) is not used" in str(w.message) for w in caught)
