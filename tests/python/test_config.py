"""The Python view of the config: shipped configs load, errors arrive as ValueError naming the
key path, ignored DeepSpeed keys are listed as warnings, and to_dict round-trips.
The C++ tests (tests/cpp/test_config.cpp) are the thorough ones."""

import pickle
from pathlib import Path

import pytest

import zeroshard

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = {
    "zero0.json": (0, "fp32"),
    "zero1.json": (1, "fp32"),
    "zero2.json": (2, "fp32"),
    "zero3.json": (3, "fp32"),
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
    with pytest.raises(ValueError, match="Hugging Face Trainer"):
        zeroshard.Config.from_json('{"train_micro_batch_size_per_gpu": "auto"}')
    with pytest.raises(ValueError, match="no such file"):
        zeroshard.Config.from_file(str(CONFIGS / "missing.json"))
    with pytest.raises(ValueError):
        zeroshard.Config.from_dict({"gradient_clipping": float("nan")})


def test_ignored_deepspeed_keys_are_listed_as_warnings():
    with pytest.warns(UserWarning) as record:
        cfg = zeroshard.Config.from_dict(
            {
                "train_micro_batch_size_per_gpu": 4,
                "steps_per_print": 10,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        )
    assert [str(w.message) for w in record] == cfg.warnings
    assert len(cfg.warnings) == 2
    assert cfg.warnings[0].startswith('"steps_per_print" is a DeepSpeed key')
    assert '"zero_optimization.offload_optimizer"' in cfg.warnings[1]


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
