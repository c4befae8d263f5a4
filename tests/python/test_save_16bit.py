"""save_16bit_model: at every stage rank 0 writes one file holding the model's state dict (its
own names, trained parameters in the compute dtype, buffers and frozen parameters as held),
streamed tensor by tensor, stage 3 gathering one unit at a time; readable by safetensors,
torch.load(weights_only=True) and transformers' from_pretrained. DeepSpeed's behaviour: stage 3
without stage3_gather_16bit_weights_on_model_save writes nothing, warns and returns False.

Each case trains StatefulTransformer (a tied head, a frozen parameter, a float and a long
buffer) for two steps on 2 real processes (Gloo), then saves. The cases share one spawned pair
of ranks (spawn.SharedRuns), each in a directory of its own under EXPORTS, each with its own
result and failure.
"""

import importlib.util
import os
import warnings

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import train as _train
from model_state import padded_numel
from models import make_stateful_model
from spawn import SharedRuns

FILES = ("model.safetensors", "pytorch_model.bin")
TIED = "head.weight"  # the second name of embed.weight
BYTES = {"fp32": 4, "bf16": 2}
PRECISIONS = ("fp32", "bf16")


def _cases(exports):
    """The shared run's cases, each saving under exports / its name. Set up here: the write
    error case's previous file."""
    (exports / "write_error").mkdir()
    (exports / "write_error" / "model.safetensors").write_bytes(b"previous")
    cases = {}
    for stage in (0, 1, 2, 3):
        for precision in PRECISIONS:
            # Below stage 3 the flag is not needed (DeepSpeed's too): the parameters are whole.
            cases[f"full_stage{stage}_{precision}"] = (_save, stage, precision, stage == 3)
    cases["no_gather_flag"] = (_save, 3, "bf16", False)
    cases["exclude_frozen"] = (_save, 3, "fp32", True, True)
    for precision in PRECISIONS:
        cases[f"unit_peak_{precision}"] = (_export_stats, 3, precision)
        cases[f"stage2_peak_{precision}"] = (_export_stats, 2, precision)
    cases["write_error"] = (_fail_mid_write_then_save, 4096)
    cases["save_dir_created"] = (_save, 1, "fp32")
    if importlib.util.find_spec("transformers") is not None:  # else the from_pretrained cases skip
        for precision in PRECISIONS:
            cases[f"gpt2_{precision}"] = (_train_gpt2, precision)
    # Each case's directory is its first argument after the function: exports / name.
    return {2: {name: (fn, str(_out(exports, name)), *args) for name, (fn, *args) in cases.items()}}


def _out(exports, name):
    return exports / name / "a" / "b" if name == "save_dir_created" else exports / name


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def runs(exports):
    return SharedRuns(_cases(exports))


def _engine(rank, world_size, stage, precision, gather):
    import zeroshard

    model = make_stateful_model(0)
    config = _config(world_size, stage, precision)
    if gather:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = zeroshard.initialize(model, config)
    _train(model, engine, rank, world_size, range(2))
    return model, engine


def _save(rank, world_size, out, stage, precision, gather=True, exclude_frozen=False):
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


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_file_holds_the_full_state_dict_bitwise_at_every_stage(runs, exports, stage, precision):
    from safetensors import safe_open
    from safetensors.torch import load_file

    name = f"full_stage{stage}_{precision}"
    out = _out(exports, name)
    results = runs.result(2, name)
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


def test_stage_3_without_the_gather_flag_writes_nothing_warns_and_returns_false(runs, exports):
    out = _out(exports, "no_gather_flag")
    results = runs.result(2, "no_gather_flag")
    for rank, (saved, caught, _) in enumerate(results):
        assert saved == [False, False]
        assert len(caught) == (2 if rank == 0 else 0)  # the same words on every rank: rank 0 says them
        for message, filename in caught:
            assert "stage3_gather_16bit_weights_on_model_save" in message and "did not save" in message
            assert filename == __file__  # the user's line, not zeroshard's
    assert not out.exists()


def test_exclude_frozen_parameters_leaves_out_only_the_frozen_ones(runs, exports):
    from safetensors.torch import load_file

    out = _out(exports, "exclude_frozen")
    results = runs.result(2, "exclude_frozen")
    state = results[0][2]
    del state["frozen"]
    _assert_same(torch.load(out / "pytorch_model.bin", weights_only=True), state)
    del state[TIED]
    _assert_same(load_file(out / "model.safetensors"), state)


def _export_stats(rank, world_size, out, stage, precision):
    from zeroshard import _C

    _, engine = _engine(rank, world_size, stage, precision, True)
    stats = _C._save_16bit_model(engine._core, out, "model.safetensors", [])
    units = [padded_numel(u["numel"], world_size) for u in engine.stage3_units()]
    return stats, units


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage_3_gathers_one_unit_at_a_time(runs, exports, precision):
    """The export's peak of gathered parameters is the largest unit's, on every rank, where
    gathering the model (gathered_parameters()) would hold all of them at once."""
    out = _out(exports, f"unit_peak_{precision}")
    results = runs.result(2, f"unit_peak_{precision}")
    for rank, (stats, units) in enumerate(results):
        assert len(units) == 3  # blocks.0, blocks.1 and the root (embedding, tied head, norm, ...)
        assert stats["saved"]
        assert stats["gathered_peak"] == BYTES[precision] * max(units)
        assert stats["gathered_peak"] < BYTES[precision] * sum(units)
        assert stats["file_bytes"] == (os.path.getsize(out / "model.safetensors") if rank == 0 else 0)
    below = runs.result(2, f"stage2_peak_{precision}")
    assert [stats["gathered_peak"] for stats, _ in below] == [0, 0]  # whole already: nothing gathered


def _fail_mid_write_then_save(rank, world_size, out, limit):
    import resource
    import signal

    model, engine = _engine(rank, world_size, 3, "fp32", True)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0:
        # Writes past `limit` bytes fail with EFBIG (the signal it would also raise is ignored):
        # the header and the first tensors go out, then the write fails with units still to gather.
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        engine.save_16bit_model(out)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        if rank == 0:  # the next cases of the shared run write files as usual
            signal.signal(signal.SIGXFSZ, handler)
    left = sorted(os.listdir(out)) if rank == 0 else None
    previous = open(os.path.join(out, "model.safetensors"), "rb").read() if rank == 0 else None
    # Every unit was released: the engine trains on and the next save is complete.
    _train(model, engine, rank, world_size, range(2, 3))
    assert engine.save_16bit_model(out)
    return error, left, previous, engine.full_state_dict(rank0_only=True)


def test_a_write_error_on_rank_0_fails_every_rank_and_leaves_the_previous_file(runs, exports):
    from safetensors.torch import load_file

    out = _out(exports, "write_error")  # holding a file "previous" before the run (_cases)
    results = runs.result(2, "write_error")
    (error0, left, previous, state), (error1, _, _, _) = results
    assert error0 is not None and "File too large" in error0 and str(out / "model.safetensors") in error0
    assert error1 is not None and "failed on rank(s) 0" in error1 and "no file was written" in error1
    assert left == ["model.safetensors"] and previous == b"previous"
    _assert_same(load_file(out / "model.safetensors"), {k: v for k, v in state.items() if k != TIED})


def test_save_dir_is_created(runs, exports):
    out = _out(exports, "save_dir_created")
    results = runs.result(2, "save_dir_created")
    assert results[0][0] == [True, True]
    assert sorted(os.listdir(out)) == sorted(FILES)


GPT2_SIZES = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)


def _train_gpt2(rank, world_size, out, precision):
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


@pytest.mark.parametrize("precision", PRECISIONS)
def test_transformers_from_pretrained_loads_the_stage_3_export(runs, exports, precision, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _out(exports, f"gpt2_{precision}")
    state = runs.result(2, f"gpt2_{precision}")[0]
    assert "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    # This process never built an engine: the directory alone is the model.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=dtype)
    _assert_same({k: v.detach() for k, v in loaded.state_dict().items()}, state)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
