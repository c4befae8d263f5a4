"""save_16bit_model: at every stage rank 0 writes one file holding the model's state dict (its
own names, trained parameters in the compute dtype, buffers and frozen parameters as held),
streamed tensor by tensor, stage 3 gathering one unit at a time; readable by safetensors,
torch.load(weights_only=True) and transformers' from_pretrained. DeepSpeed's behaviour: stage 3
without stage3_gather_16bit_weights_on_model_save writes nothing, warns and returns False.

Each case trains StatefulTransformer (a tied head, a frozen parameter, a float and a long
buffer) for two steps on 2 real processes (Gloo), then saves.
"""

import os
import warnings

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import train as _train
from model_state import padded_numel
from models import make_stateful_model
from spawn import run_ranks

FILES = ("model.safetensors", "pytorch_model.bin")
TIED = "head.weight"  # the second name of embed.weight
BYTES = {"fp32": 4, "bf16": 2}


def _engine(rank, world_size, stage, precision, gather):
    import zeroshard

    model = make_stateful_model(0)
    config = _config(world_size, stage, precision)
    if gather:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = zeroshard.initialize(model, config)
    _train(model, engine, rank, world_size, range(2))
    return model, engine


def _save(rank, world_size, stage, precision, out, gather=True, exclude_frozen=False):
    """Saves both formats; returns what each call returned, the warnings it gave (message and
    the file they are attributed to) and, on rank 0, the engine's full state dict."""
    _, engine = _engine(rank, world_size, stage, precision, gather)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = [engine.save_16bit_model(out, name, exclude_frozen_parameters=exclude_frozen) for name in FILES]
    state = engine.full_state_dict(rank0_only=True)
    return saved, [(str(w.message), w.filename) for w in caught], state


def _assert_same(loaded, expected):
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_file_holds_the_full_state_dict_bitwise_at_every_stage(tmp_path, stage, precision):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "export"
    # Below stage 3 the flag is not needed (DeepSpeed's too): the parameters are whole.
    results = run_ranks(_save, 2, stage, precision, str(out), stage == 3)
    for saved, caught, _ in results:
        assert saved == [True, True] and caught == []
    state = results[0][2]
    assert state["embed.weight"].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert state["temperature"].dtype == torch.float32 and state["steps"].dtype == torch.long
    assert sorted(os.listdir(out)) == sorted(FILES)  # nothing partial left beside them

    # safetensors: every entry once; the tied head only under its first name, as save_pretrained.
    _assert_same(load_file(out / "model.safetensors"), {k: v for k, v in state.items() if k != TIED})
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    # torch: every name, in the model's order, the tied pair sharing one storage.
    loaded = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert list(loaded) == list(state)
    _assert_same(loaded, state)
    assert loaded[TIED].untyped_storage().data_ptr() == loaded["embed.weight"].untyped_storage().data_ptr()
    # As transformers reads .bin files: memory-mapped, and on the meta device.
    _assert_same(torch.load(out / "pytorch_model.bin", weights_only=True, mmap=True), state)
    meta = torch.load(out / "pytorch_model.bin", weights_only=True, map_location="meta")
    assert {k: (v.dtype, v.shape) for k, v in meta.items()} == {k: (v.dtype, v.shape) for k, v in state.items()}


def test_stage_3_without_the_gather_flag_writes_nothing_warns_and_returns_false(tmp_path):
    out = tmp_path / "export"
    results = run_ranks(_save, 2, 3, "bf16", str(out), False)
    for saved, caught, _ in results:
        assert saved == [False, False]
        assert len(caught) == 2
        for message, filename in caught:
            assert "stage3_gather_16bit_weights_on_model_save" in message and "did not save" in message
            assert filename == __file__  # the user's line, not zeroshard's
    assert not out.exists()


def test_exclude_frozen_parameters_leaves_out_only_the_frozen_ones(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "export"
    results = run_ranks(_save, 2, 3, "fp32", str(out), True, True)
    state = results[0][2]
    del state["frozen"]
    _assert_same(torch.load(out / "pytorch_model.bin", weights_only=True), state)
    del state[TIED]
    _assert_same(load_file(out / "model.safetensors"), state)


def _export_stats(rank, world_size, stage, precision, out):
    from zeroshard import _C

    _, engine = _engine(rank, world_size, stage, precision, True)
    stats = _C._save_16bit_model(engine._core, out, "model.safetensors", [])
    units = [padded_numel(u["numel"], world_size) for u in engine.stage3_units()]
    return stats, units


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_3_gathers_one_unit_at_a_time(tmp_path, precision):
    """The export's peak of gathered parameters is the largest unit's, on every rank, where
    gathering the model (gathered_parameters()) would hold all of them at once."""
    out = tmp_path / "export"
    results = run_ranks(_export_stats, 2, 3, precision, str(out))
    for rank, (stats, units) in enumerate(results):
        assert len(units) == 3  # blocks.0, blocks.1 and the root (embedding, tied head, norm, ...)
        assert stats["saved"]
        assert stats["gathered_peak"] == BYTES[precision] * max(units)
        assert stats["gathered_peak"] < BYTES[precision] * sum(units)
        assert stats["file_bytes"] == (os.path.getsize(out / "model.safetensors") if rank == 0 else 0)
    below = run_ranks(_export_stats, 2, 2, precision, str(tmp_path / "stage2"))
    assert [stats["gathered_peak"] for stats, _ in below] == [0, 0]  # whole already: nothing gathered


def _fail_mid_write_then_save(rank, world_size, out, limit):
    import resource
    import signal

    model, engine = _engine(rank, world_size, 3, "fp32", True)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0:
        # Writes past `limit` bytes fail with EFBIG (the signal it would also raise is ignored):
        # the header and the first tensors go out, then the write fails with units still to gather.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        engine.save_16bit_model(out)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    left = sorted(os.listdir(out)) if rank == 0 else None
    previous = open(os.path.join(out, "model.safetensors"), "rb").read() if rank == 0 else None
    # Every unit was released: the engine trains on and the next save is complete.
    _train(model, engine, rank, world_size, range(2, 3))
    assert engine.save_16bit_model(out)
    return error, left, previous, engine.full_state_dict(rank0_only=True)


def test_a_write_error_on_rank_0_fails_every_rank_and_leaves_the_previous_file(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"previous")
    results = run_ranks(_fail_mid_write_then_save, 2, str(out), 4096)
    (error0, left, previous, state), (error1, _, _, _) = results
    assert error0 is not None and "File too large" in error0 and str(out / "model.safetensors") in error0
    assert error1 is not None and "failed on rank(s) 0" in error1 and "no file was written" in error1
    assert left == ["model.safetensors"] and previous == b"previous"
    _assert_same(load_file(out / "model.safetensors"), {k: v for k, v in state.items() if k != TIED})


def test_save_dir_is_created(tmp_path):
    out = tmp_path / "a" / "b"
    results = run_ranks(_save, 2, 1, "fp32", str(out))
    assert results[0][0] == [True, True]
    assert sorted(os.listdir(out)) == sorted(FILES)


GPT2_SIZES = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)


def _train_gpt2(rank, world_size, precision, out):
    import transformers

    import zeroshard
    from training import engine_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SIZES))
    config = engine_config(3, precision=precision, zero={"stage3_gather_16bit_weights_on_model_save": True,
                                                         "stage3_param_persistence_threshold": 0})
    engine = zeroshard.initialize(model, config)
    assert [u["name"] for u in engine.stage3_units()][:2] == ["transformer.h.0", "transformer.h.1"]
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, GPT2_SIZES["vocab_size"], (2, GPT2_SIZES["n_positions"]), generator=g)
        engine.backward(model(input_ids=tokens, labels=tokens).loss)
        engine.step()
    assert engine.save_16bit_model(out)
    if rank == 0:
        model.config.save_pretrained(out)
    return engine.full_state_dict(rank0_only=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_transformers_from_pretrained_loads_the_stage_3_export(tmp_path, precision, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "gpt2"
    state = run_ranks(_train_gpt2, 2, precision, str(out), timeout=180)[0]
    assert "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    # This process never built an engine: the directory alone is the model.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=dtype)
    _assert_same({k: v.detach() for k, v in loaded.state_dict().items()}, state)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
