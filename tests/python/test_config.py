"""The Python view of the config: shipped configs load, errors arrive as ValueError naming the
key path, ignored DeepSpeed keys are listed as warnings, and to_dict round-trips.
The C++ tests (tests/cpp/test_config.cpp) are the thorough ones."""

import pickle
from pathlib import Path

import pytest

from spawn import run_ranks

import zeroshard

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = {
    "zero0.json": (0, "fp32"),
    "zero1.json": (1, "fp32"),
    "zero2.json": (2, "fp32"),
    "zero3.json": (3, "fp32"),
    "hybrid.json": (3, "fp32"),
    "bf16.json": (3, "bf16"),
    "fp16.json": (2, "fp16"),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_loads_as_named(name):
    stage, precision = SHIPPED[name]
    cfg = zeroshard.Config.from_file(str(CONFIGS / name))
    assert cfg.stage == stage == cfg.zero_optimization.stage
    assert cfg.bf16_enabled == (precision == "bf16")
    assert cfg.fp16_enabled == (precision == "fp16")
    assert cfg.warnings == []
    assert cfg.optimizer.type == "AdamW"
    assert cfg.gradient_clipping == 1.0
    assert cfg.train_batch_size is None
    assert cfg.source.endswith(name)
    assert name in repr(cfg)


def test_errors_are_value_errors_with_path_and_suggestion():
    with pytest.raises(ValueError) as e:
        zeroshard.Config.from_dict({"zero_optimization": {"stag": 2}})
    message = str(e.value)
    assert message.startswith("zeroshard config (<dict>): ")
    assert 'unknown key "zero_optimization.stag"; did you mean "zero_optimization.stage"?' in message

    with pytest.raises(ValueError, match=r"zero_optimization.stage: must be 0, 1, 2 or 3, got 4"):
        zeroshard.Config.from_dict({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match="no such file"):
        zeroshard.Config.from_file(str(CONFIGS / "missing.json"))
    with pytest.raises(ValueError):
        zeroshard.Config.from_dict({"gradient_clipping": float("nan")})


def test_ignored_deepspeed_keys_are_listed_as_warnings():
    with pytest.warns(UserWarning) as record:
        cfg = zeroshard.Config.from_dict(
            {
                "train_micro_batch_size_per_gpu": 4,
                "flops_profiler": {"enabled": False},
                "zero_optimization": {"stage": 2, "sub_group_size": 1e9},
            }
        )
    assert [str(w.message) for w in record] == cfg.warnings
    assert len(cfg.warnings) == 2
    assert cfg.warnings[0].startswith('"flops_profiler" is a DeepSpeed key')
    assert '"zero_optimization.sub_group_size"' in cfg.warnings[1]


def test_batch_sizes_follow_deepspeed_rules():
    cfg = zeroshard.Config.from_dict(
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    assert cfg.batch_sizes(4) == {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    mismatch = zeroshard.Config.from_dict({"train_batch_size": 32, **cfg.to_dict()})
    with pytest.raises(ValueError, match=r"train_batch_size \(32\) != .* = 16"):
        mismatch.batch_sizes(2)


def test_to_dict_round_trips_and_pickles():
    cfg = zeroshard.Config.from_file(str(CONFIGS / "fp16.json"))
    d = cfg.to_dict()
    assert d["zero_optimization"]["stage"] == 2
    assert d["optimizer"]["params"]["betas"] == [0.9, 0.999]
    again = zeroshard.Config.from_dict(d)
    assert again.to_dict() == d
    assert again.to_json() == cfg.to_json()
    assert cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.fp16.loss_scale == 0.0

    copy = pickle.loads(pickle.dumps(cfg))
    assert copy.to_json() == cfg.to_json()
    assert copy.source == cfg.source
    assert copy.warnings == cfg.warnings


# Every key the reader accepts (zeroshard._C._config_keys()) and how it takes effect:
#   ("field", token, value): setting `value` changes the parsed config, and `token` (the field
#       it fills) is read by the engine: it appears in csrc/zeroshard/ outside the config
#       layer, or in python/zeroshard/;
#   ("refuses", value): only the value zeroshard implements is accepted (others are errors);
#   ("warns", value): that value is ignored with a warning;
#   ("section", None): an object whose keys are listed themselves;
#   ("switch", sibling, value): the section's keys marked "inert" do nothing unless this key,
#       beside them, is set to `value` (then the section warns or fails on the switch).
KEY_EFFECTS = {
    "train_batch_size": ("field", r"batchSizes\(", 8),
    "train_micro_batch_size_per_gpu": ("field", r"batchSizes\(", 4),
    "gradient_accumulation_steps": ("field", r"batchSizes\(", 2),
    "gradient_clipping": ("field", r"gradientClipping", 1.0),
    "fp16": ("section", None, None),
    "bf16": ("section", None, None),
    "bfloat16": ("section", None, None),
    "optimizer": ("section", None, None),
    "zero_optimization": ("section", None, None),
    "zeroshard": ("section", None, None),
    "fp16.enabled": ("field", r"fp16\.enabled", True),
    "fp16.loss_scale": ("field", r"config\.lossScale", 128.0),
    "fp16.initial_scale_power": ("field", r"config\.initialScalePower", 8),
    "fp16.loss_scale_window": ("field", r"config\.lossScaleWindow", 10),
    "fp16.hysteresis": ("field", r"config\.hysteresis", 3),
    "fp16.min_loss_scale": ("field", r"config\.minLossScale", 2.0),
    "bf16.enabled": ("field", r"bf16\.enabled", True),
    "optimizer.type": ("refuses", "SGD"),
    "optimizer.params": ("section", None, None),
    "optimizer.params.lr": ("field", r"o\.lr\b", 0.5),
    "optimizer.params.betas": ("field", r"o\.beta1\b.*o\.beta2\b", [0.5, 0.6]),
    "optimizer.params.eps": ("field", r"o\.eps\b", 1e-3),
    "optimizer.params.weight_decay": ("field", r"o\.weightDecay\b", 0.5),
    "optimizer.params.adam_w_mode": ("refuses", False),
    "optimizer.params.amsgrad": ("refuses", True),
    "optimizer.params.bias_correction": ("refuses", False),
    "zero_optimization.stage": ("field", r"config\.zero\.stage\b", 2),
    "zero_optimization.reduce_bucket_size": ("field", r"zero\.reduceBucketSize", 7),
    "zero_optimization.allgather_bucket_size": ("field", r"zero\.allgatherBucketSize", 7),
    "zero_optimization.overlap_comm": ("field", r"zero\.overlapCommResolved\(", True),
    "zero_optimization.contiguous_gradients": ("warns", False),
    "zero_optimization.stage3_prefetch_bucket_size": ("field", r"zero\.stage3PrefetchBucketSize", 7),
    "zero_optimization.prefetch_bucket_size": ("field", r"zero\.stage3PrefetchBucketSize", 7),
    "zero_optimization.stage3_param_persistence_threshold": ("field", r"zero\.stage3ParamPersistenceThreshold", 7),
    "zero_optimization.param_persistence_threshold": ("field", r"zero\.stage3ParamPersistenceThreshold", 7),
    "zero_optimization.stage3_max_live_parameters": ("field", r"zero\.stage3MaxLiveParameters", 7),
    "zero_optimization.max_live_parameters": ("field", r"zero\.stage3MaxLiveParameters", 7),
    "zeroshard.collective_timeout_seconds": ("field", r"extras\.collectiveTimeoutSeconds", 5.0),
    "zeroshard.reshard_after_forward": ("field", r"extras\.reshardAfterForward", False),
    "zeroshard.stage3_unit_classes": ("field", r"zeroshard\.stage3_unit_classes", ["Block"]),
    "zeroshard.reduce_dtype": ("field", r"extras\.reduceDtype", "fp32"),
    "zeroshard.max_inflight_reductions": ("field", r"extras\.maxInflightReductions", 5),
    "zeroshard.checkpoint": ("section", None, None),
    "zeroshard.checkpoint.keep_last": ("field", r"extras\.checkpointKeepLast", 5),
    # every_minutes alone is refused (it needs dir); test_clock_and_batch.py saves with both.
    "zeroshard.checkpoint.every_minutes": ("refuses", 30),
    "zeroshard.checkpoint.dir": ("field", r"checkpoint_dir", "/tmp/ckpt"),
    "zeroshard.batch_guard": ("field", r"extras\.batchGuard", "error"),
    "zeroshard.nonfinite": ("field", r"extras\.nonfinite", "skip"),
    "zeroshard.stage3_gather_stream": ("field", r"stage3GatherStream", True),
    "zeroshard.nonfinite_check": ("field", r"extras\.nonfiniteCheck", "deferred"),
    "steps_per_print": ("field", r"stepsPerPrint", 3),
    "wall_clock_breakdown": ("field", r"wallClockBreakdown", True),
    "scheduler": ("section", None, None),
    "scheduler.type": ("field", r"scheduler\.type|LrSchedule", "WarmupLR"),
    "scheduler.params": ("section", None, None),
    "tensor_parallel": ("section", None, None),
    "tensor_parallel.autotp_size": ("refuses", 2),
    "tensor_parallel.tp": ("section", None, None),
    "tensor_parallel.tensor_parallel": ("section", None, None),
    "tensor_parallel.tp.tp_size": ("refuses", 2),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("field", r"gather16bitWeightsOnModelSave", True),
    "zero_optimization.gather_16bit_weights_on_model_save": ("field", r"gather16bitWeightsOnModelSave", True),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": ("field", r"gather16bitWeightsOnModelSave", True),
    "zero_optimization.reduce_scatter": ("warns", False),
    "zero_optimization.allgather_partitions": ("warns", False),
    "zero_optimization.offload_optimizer": ("section", None, None),
    "zero_optimization.offload_param": ("section", None, None),
    # "cpu" at the default stage 0 warns (nothing to offload there); test_offload.py trains with it.
    "zero_optimization.offload_optimizer.device": ("warns", "cpu"),
    "zero_optimization.offload_param.device": ("warns", "cpu"),
    "zero_optimization.offload_optimizer.pin_memory": ("field", r"offloadOptimizer\.pinMemory", False),
    "zero_optimization.offload_optimizer.ratio": ("field", r"offloadOptimizer\.ratio", 0.5),
    "zero_optimization.offload_param.pin_memory": ("field", r"offloadParam\.pinMemory", False),
    "zero_optimization.mics_shard_size": ("field", r"extras\.shardGroupSize", 2),
    "zeroshard.shard_group_size": ("field", r"extras\.shardGroupSize", 2),
    # hpZ is stage 3's: at the default stage 0 it warns; test_hpz.py trains with it.
    "zero_optimization.zero_hpz_partition_size": ("warns", 2),
    "compile": ("section", None, None),
    "compile.enabled": ("field", r"compile\.enabled", True),
    "compile.backend": ("field", r"section\.backend", "eager"),
    "compile.kwargs": ("field", r"section\.kwargs", {"mode": "max-autotune"}),
}

# The keys marked "inert" and the key beside them that switches their feature on.
INERT_SWITCHES = {
    # The NVMe knobs: "cpu" switches them off as "none" does; "nvme" is refused.
    "zero_optimization.offload_optimizer": ("device", "nvme"),
    "zero_optimization.offload_param": ("device", "nvme"),
    "tensor_parallel": ("autotp_size", 2),
    "tensor_parallel.tp": ("tp_size", 2),
}

ROOT = Path(__file__).resolve().parents[2]


def _engine_sources():
    """The code that runs training: the C++ core outside its config layer, and the Python
    package; a key's field must be read there to take effect."""
    core = [p for p in (ROOT / "csrc" / "zeroshard").rglob("*.*") if not p.name.startswith("config")]
    return "\n".join(p.read_text() for p in core + sorted((ROOT / "python" / "zeroshard").glob("*.py")))


def _nested(path, value):
    out = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def test_every_accepted_key_takes_effect_or_warns():
    """A key the reader accepts is either read into a field the engine uses (and a non-default
    value changes the parsed config), accepted only at the value zeroshard implements, or a
    warning naming it; never parsed and dropped. Adding a key to the reader without wiring it
    fails here until it has an entry in KEY_EFFECTS that holds."""
    import re
    import warnings

    sources = _engine_sources()
    default = zeroshard.Config.from_dict({}).to_dict()
    accepted = zeroshard._C._config_keys()
    assert accepted, "the reader lists its keys"
    for section, key, kind in accepted:
        path = f"{section}.{key}" if section else key
        if kind == "inert":
            # Without the switch: accepted, silently, as DeepSpeed has nothing to do with it
            # either; with it: the section warns or fails, naming it.
            switch, on = INERT_SWITCHES[section]
            assert zeroshard.Config.from_dict(_nested(path, 1)).warnings == [], f"{path} warns while switched off"
            switched = _nested(section, {key: 1, switch: on})
            try:
                warned = zeroshard.Config.from_dict(switched).warnings
            except ValueError as e:
                assert section in str(e)
            else:
                assert any(f'"{section}"' in w for w in warned), f"{path} is accepted with {switch}={on!r} silently"
            continue
        if kind == "ignored":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cfg = zeroshard.Config.from_dict(_nested(path, 1))
            assert any(f'"{path}"' in w for w in cfg.warnings), f"{path}: ignored without a warning"
            assert any(f'"{path}"' in str(w.message) for w in caught), f"{path}: no Python warning"
            continue
        assert path in KEY_EFFECTS, f"{path} is accepted but neither used by the engine nor listed as ignored"
        effect, *rest = KEY_EFFECTS[path]
        if effect == "section":
            assert kind == "read"
        elif effect == "refuses":
            with pytest.raises(ValueError, match=re.escape(path)):
                zeroshard.Config.from_dict(_nested(path, rest[0]))
        elif effect == "warns":
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                cfg = zeroshard.Config.from_dict(_nested(path, rest[0]))
            assert any(f'"{path}"' in w for w in cfg.warnings), f"{path}={rest[0]} is dropped without a warning"
        else:
            token, value = rest
            assert zeroshard.Config.from_dict(_nested(path, value)).to_dict() != default, \
                f"{path}={value!r} does not change the parsed config"
            assert re.search(token, sources), f"{path}: its field ({token}) is read nowhere outside the config layer"
    listed = {f"{s}.{k}" if s else k for s, k, kind in accepted if kind == "read"}
    assert listed == set(KEY_EFFECTS), f"KEY_EFFECTS lists keys the reader no longer accepts: {set(KEY_EFFECTS) - listed}"


def test_the_compile_section_is_read_and_its_bad_values_named():
    cfg = zeroshard.Config.from_dict({"compile": {"enabled": True, "backend": "eager", "kwargs": {"dynamic": False}}})
    assert (cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs) == (True, "eager", {"dynamic": False})
    default = zeroshard.Config.from_dict({}).compile
    assert (default.enabled, default.backend, default.kwargs) == (False, "inductor", {})
    for section, message in [({"backend": 3}, r"compile.backend: must be the name of a torch.compile backend"),
                             ({"backend": ""}, r"compile.backend: must be the name"),
                             ({"kwargs": [1]}, r"compile.kwargs: must be an object of torch.compile's keyword"),
                             ({"kwargs": {"backend": "eager"}}, r"compile.kwargs: \"backend\" goes in compile.backend")]:
        with pytest.raises(ValueError, match=message):
            zeroshard.Config.from_dict({"compile": section})
    # DeepCompile is DeepSpeed's own compiler passes: named in a warning, not run.
    with pytest.warns(UserWarning, match=r'"compile.deepcompile" is a DeepSpeed key zeroshard does not implement'):
        zeroshard.Config.from_dict({"compile": {"deepcompile": True}})


def _user_line():
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_warnings_point_at_the_users_line():
    """A warning about the user's config names the user's file and line, whether the config is
    read directly or through zeroshard.initialize, not a line inside zeroshard."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _user_line(); zeroshard.Config.from_dict({"tensorboard": {}})  # noqa: E702
    assert [(Path(w.filename).name, w.lineno) for w in caught] == [("test_config.py", line)]
    (filename, lineno), expected = run_ranks(_initialize_warning, 1)[0]
    assert (Path(filename).name, lineno) == ("test_config.py", expected)


def _initialize_warning(rank, world_size):
    import warnings

    import torch

    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _user_line(); zeroshard.initialize(model, {"train_micro_batch_size_per_gpu": 1, "tensorboard": {}})  # noqa: E702
    [w] = [w for w in caught if "tensorboard" in str(w.message)]
    return (w.filename, w.lineno), line
