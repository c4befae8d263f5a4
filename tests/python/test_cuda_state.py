"""CUDA at world size 1 (NCCL): model state in and out of GPU engines. A checkpoint of CUDA
tensors resumes bitwise and loads at another stage; save_16bit_model writes the GPU state into
files a CPU reads; a model built on the meta device initialises on the GPU as one built there,
and takes pretrained weights there. Skipped where torch has no CUDA device (CI on CPU);
benchmarks/gpu_check.sh runs it.

The model is StatefulTransformer (a head tied to the embedding, a frozen parameter, a float and
a long buffer that training changes), so every kind of state crosses between device and files.
"""

import pytest
import torch

from checkpoint_runs import config as checkpoint_config
from checkpoint_runs import train
from cuda_runs import (DEVICE, assert_bitwise, group,  # noqa: F401 (group: a fixture)
                       needs_cuda, state_of, with_gather_stream)
from models import make_stateful_model
from training import train_global_batches

pytestmark = needs_cuda

SAVED, RESUMED = 2, 2  # steps before the checkpoint, and after it
RTOL, ATOL = 1e-4, 1e-5


def _ways(cases):
    """(stage, gather_stream, precision) for each (stage, precision): stage 3 both ways."""
    return [pytest.param(stage, on, precision, id=f"stage{stage}-{precision}" + (f"-{way}" if stage == 3 else ""))
            for stage, precision in cases
            for way, on in ([("compute_stream", False), ("gather_stream", True)] if stage == 3 else [("", False)])]


def _engine(group, seed, stage, gather_stream, precision, meta=False, **zero):
    import zeroshard
    from test_load_pretrained import _no_init

    config = with_gather_stream(checkpoint_config(1, stage, precision), stage, gather_stream)
    config["zero_optimization"] |= zero
    if meta:
        with torch.device("meta"):
            model = make_stateful_model(seed)
    else:
        model = make_stateful_model(seed).to(DEVICE)
    engine = zeroshard.initialize(model, config, process_group=group, init_fn=_no_init if meta else None)
    return model, engine


def _on_device(model):
    """Every parameter and buffer is on the GPU (a stage-3 parameter keeps its device while it
    holds no storage)."""
    return {t.device.type for t in model.state_dict().values()} == {DEVICE}


@pytest.mark.parametrize("stage,gather_stream,precision", _ways([(1, "fp32"), (2, "fp16"), (3, "bf16"), (3, "fp32")]))
def test_a_checkpoint_of_cuda_state_resumes_bitwise(group, tmp_path, stage, gather_stream, precision):
    """Saved after SAVED steps, loaded by a fresh engine of a differently seeded model: the next
    RESUMED steps are those of the run that went on, to the bit. A client state holding a CUDA
    tensor comes back with it."""
    model, engine = _engine(group, 0, stage, gather_stream, precision)
    train(model, engine, 0, 1, range(SAVED))
    marker = torch.arange(3.0, device=DEVICE)
    engine.save_checkpoint(tmp_path, client_state={"next_step": SAVED, "on_device": marker})
    losses = train(model, engine, 0, 1, range(SAVED, SAVED + RESUMED))
    expected, counters = state_of(engine), (engine.global_steps, engine.loss_scale)

    model, engine = _engine(group, 1234, stage, gather_stream, precision)
    _, client = engine.load_checkpoint(tmp_path)
    assert client["next_step"] == SAVED and torch.equal(client["on_device"].cpu(), marker.cpu()), client
    assert _on_device(model)
    assert train(model, engine, 0, 1, range(SAVED, SAVED + RESUMED)) == losses
    resumed = state_of(engine)
    for kind in expected:
        assert_bitwise(resumed[kind], expected[kind], f"stage {stage} {precision}, resumed {kind}")
    assert (engine.global_steps, engine.loss_scale) == counters


@pytest.mark.parametrize("saved,loaded", [(3, 1), (1, 3), (2, 3)], ids=["stage3_to_1", "stage1_to_3", "stage2_to_3"])
def test_a_checkpoint_saved_on_cuda_loads_at_another_stage(group, tmp_path, saved, loaded):
    """fp32: the resumed steps follow the run that went on, to fp32 rounding (the reductions and
    the shards are cut differently at another stage)."""
    model, engine = _engine(group, 0, saved, False, "fp32")
    train(model, engine, 0, 1, range(SAVED))
    engine.save_checkpoint(tmp_path)
    losses = train(model, engine, 0, 1, range(SAVED, SAVED + RESUMED))
    expected = engine.full_state_dict()

    model, engine = _engine(group, 1234, loaded, False, "fp32")
    engine.load_checkpoint(tmp_path)
    assert _on_device(model)
    assert train(model, engine, 0, 1, range(SAVED, SAVED + RESUMED)) == pytest.approx(losses, rel=1e-5)
    state = engine.full_state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage,gather_stream,precision", _ways([(1, "fp32"), (3, "bf16")]))
def test_save_16bit_model_on_cuda_writes_files_a_cpu_reads(group, tmp_path, stage, gather_stream, precision):
    """Both formats hold the engine's full state dict bitwise (test_save_16bit.py's checks), as
    CPU tensors: a file written from GPU memory loads on a machine without one."""
    from safetensors.torch import load_file
    from test_save_16bit import FILES, TIED, _assert_same

    gather = {"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {}
    model, engine = _engine(group, 0, stage, gather_stream, precision, **gather)
    train(model, engine, 0, 1, range(2))
    assert [engine.save_16bit_model(tmp_path, name) for name in FILES] == [True, True]
    state = engine.full_state_dict()
    safetensors, torch_file = load_file(tmp_path / FILES[0]), torch.load(tmp_path / FILES[1], weights_only=True)
    assert {v.device.type for v in [*safetensors.values(), *torch_file.values()]} == {"cpu"}
    _assert_same(safetensors, {k: v for k, v in state.items() if k != TIED})
    _assert_same(torch_file, state)
    # Gathering for the export released what it gathered: training goes on.
    train(model, engine, 0, 1, range(2, 3))
    assert _on_device(model)


@pytest.mark.parametrize("stage,gather_stream,precision",
                         _ways([(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")]))
def test_a_meta_model_initialises_on_cuda_as_a_model_built_there(group, stage, gather_stream, precision):
    """initialize draws on the GPU's generator, module by module in construction order
    (test_meta_init.py's model), so the shards are bitwise those of the model built on the GPU
    with the same seed, and so are the weights after two steps and the bytes held."""
    import zeroshard
    from test_meta_init import SEED, MetaTransformer, config

    runs = {}
    for device in ("meta", DEVICE):
        torch.manual_seed(SEED)
        with torch.device(device):
            model = MetaTransformer()
        engine = zeroshard.initialize(model, with_gather_stream(config(stage, precision), stage, gather_stream),
                                      process_group=group)
        assert _on_device(model), device
        start = state_of(engine)
        train_global_batches(model, engine, 0, 1, range(2))
        memory = {k: v for k, v in engine.memory_stats().items() if not k.endswith("_peak")}
        runs[device] = (start, state_of(engine), memory)
    for when, (meta, built) in enumerate(zip(runs["meta"][:2], runs[DEVICE][:2])):
        for kind in meta:
            assert_bitwise(meta[kind], built[kind], f"stage {stage} {precision}, {kind} after {2 * when} steps")
    assert runs["meta"][2] == runs[DEVICE][2]


@pytest.mark.parametrize("stage,gather_stream,precision", _ways([(1, "fp32"), (3, "bf16")]))
def test_a_meta_model_loads_pretrained_weights_onto_cuda(group, tmp_path, stage, gather_stream, precision):
    """A meta model with nothing drawn (init_fn does nothing) takes a safetensors file: the fp32
    masters, frozen parameter and buffers are the file's exactly (test_load_pretrained.py's
    expectation), on the GPU, and the model trains there."""
    from safetensors.torch import save_file
    from test_load_pretrained import _differing, _expected, _source

    save_file(_source(), tmp_path / "model.safetensors")
    model, engine = _engine(group, 1, stage, gather_stream, precision, meta=True)
    loaded = engine.load_pretrained(tmp_path / "model.safetensors")
    assert tuple(loaded) == ([], [], []), loaded
    assert _differing(engine.full_state_dict(dtype=torch.float32), _expected("fp32")) == []
    assert _on_device(model)
    losses = train(model, engine, 0, 1, range(2))
    assert all(torch.isfinite(torch.tensor(losses))), losses
