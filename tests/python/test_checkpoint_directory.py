"""What a checkpoint directory refuses and keeps: a flipped byte, a truncated or a missing file
is an error that names the file, on every rank, and changes nothing; so is another model's
checkpoint, and a client state that would not load back; keep_last removes older checkpoints
only after the new one is complete; a tag saved again is replaced whole. (Resuming:
test_checkpoint.py.)

The cases share one spawned run per world size (spawn.SharedRuns), each with its own result and
failure, each over a checkpoint directory of its own.
"""

import os
import re
from pathlib import Path

import pytest
import torch

from checkpoint_runs import config as _config
from checkpoint_runs import damage as _damage
from checkpoint_runs import train as _train
from models import StatefulTransformer, make_stateful_model
from spawn import SharedRuns

DAMAGES = {
    "flipped": ("rank_00000.safetensors", "flip"),
    "truncated": ("rank_00000.safetensors", "truncate"),
    "missing": ("rank_00000.safetensors", "remove"),
    "manifest_flipped": ("manifest.json", "flip"),
    "manifest_missing": ("manifest.json", "remove"),
    "module_state_flipped": ("module_state.safetensors", "flip"),
}
DAMAGE_ON_RANK_1 = {"flipped": ("rank_00001.safetensors", "flip")}
OTHER_MODELS = ("shape", "names", "buffer_dtype")
KEEP_LAST = (2, 0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Where each case saves: ckpts / its name."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def runs(ckpts):
    cases = {1: {f"other_model_{kind}": (_load_into_other_model, kind) for kind in OTHER_MODELS},
             2: {f"keep_last_{keep_last}": (_save_repeatedly, keep_last) for keep_last in KEEP_LAST}}
    cases[2]["resave_same_tag"] = (_resave_same_tag,)
    # Last: their loads and saves fail on purpose (on every rank, as the engine agrees).
    cases[1]["damaged"] = (_damaged_loads, DAMAGES)
    cases[2]["damaged_on_rank_1"] = (_damaged_loads, DAMAGE_ON_RANK_1)
    cases[2]["unloadable_client_state"] = (_unloadable_client_state,)
    cases[2]["unreadable_client_state"] = (_client_state_unreadable_on_one_rank,)
    return SharedRuns({ws: {name: (fn, str(ckpts / name), *args) for name, (fn, *args) in by_name.items()}
                       for ws, by_name in cases.items()})


def _damaged_loads(rank, world_size, ckpt, damages):
    """Saves once, then for each damage applies it to a copy and tries to load the copy.
    Returns the error per damage, and whether the failures left the engine untouched: its
    parameters, step count and lr, and (through one more step, which reads exp_avg and
    exp_avg_sq) its optimizer state, against a twin engine that never tried to load."""
    import shutil

    import zeroshard

    model, twin = make_stateful_model(0), make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    twin_engine = zeroshard.initialize(twin, _config(world_size, 2))
    for m, e in ((model, engine), (twin, twin_engine)):
        _train(m, e, rank, world_size, range(2))
    engine.save_checkpoint(ckpt, tag="base")
    errors = {}
    for name, (file, how) in damages.items():
        target = Path(ckpt) / name
        if rank == 0:
            shutil.copytree(Path(ckpt) / "base", target)
            _damage(target / file, how)
        torch.distributed.barrier()
        try:
            engine.load_checkpoint(ckpt, tag=name)
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    unchanged = engine.global_steps == twin_engine.global_steps and engine.get_lr() == twin_engine.get_lr()
    for m, e in ((model, engine), (twin, twin_engine)):
        _train(m, e, rank, world_size, range(2, 3))
    after, twin_after = engine.full_state_dict(), twin_engine.full_state_dict()
    unchanged = unchanged and all(torch.equal(after[k], twin_after[k]) for k in after)
    return errors, unchanged


def test_a_flipped_byte_a_truncated_file_and_a_missing_file_each_name_the_file(runs):
    errors, unchanged = runs.result(1, "damaged")[0]
    assert unchanged, "a failed load changed the engine"
    assert "checksum mismatch in" in errors["flipped"] and "rank_00000.safetensors" in errors["flipped"]
    assert "truncated" in errors["truncated"] and "rank_00000.safetensors" in errors["truncated"]
    assert "missing" in errors["missing"] and "rank_00000.safetensors" in errors["missing"]
    assert "manifest" in errors["manifest_flipped"] and "manifest.json" in errors["manifest_flipped"]
    assert "manifest.json' is missing" in errors["manifest_missing"]
    assert "checksum mismatch in" in errors["module_state_flipped"]
    assert "module_state.safetensors" in errors["module_state_flipped"]


def test_damage_seen_by_one_rank_fails_the_load_on_every_rank_and_changes_nothing(runs):
    outcomes = runs.result(2, "damaged_on_rank_1")
    (errors0, unchanged0), (errors1, unchanged1) = outcomes
    assert unchanged0 and unchanged1
    assert "checksum mismatch in" in errors1["flipped"] and "rank_00001.safetensors" in errors1["flipped"]
    assert "failed on rank(s) 1" in errors0["flipped"]


def _load_into_other_model(rank, world_size, ckpt, kind):
    import zeroshard

    from models import TinyTransformer

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(1))
    engine.save_checkpoint(ckpt)
    torch.manual_seed(0)
    other = StatefulTransformer(dim=32) if kind == "shape" else TinyTransformer() if kind == "names" else \
        StatefulTransformer()
    if kind == "buffer_dtype":
        other.temperature = other.temperature.double()
    other_engine = zeroshard.initialize(other, _config(world_size, 2))
    try:
        other_engine.load_checkpoint(ckpt)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(runs):
    shape_error = runs.result(1, "other_model_shape")[0]
    # dim 32 instead of 24: whichever parameter is checked first is named with both shapes.
    assert re.search(r"parameter '[\w.]+' has shape \[[\d, ]*32[\d, ]*\] here but \[[\d, ]*24[\d, ]*\] "
                     r"in checkpoint 'global_step1'", shape_error), shape_error
    names_error = runs.result(1, "other_model_names")[0]
    assert "'head.weight'" in names_error and "another model" in names_error
    dtype_error = runs.result(1, "other_model_buffer_dtype")[0]
    assert "module state 'temperature' is float64 [] here but float32 [] in checkpoint" in dtype_error


def _save_repeatedly(rank, world_size, ckpt, keep_last):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2, checkpoint={"keep_last": keep_last}))
    engine.save_checkpoint(ckpt, tag="best")  # a tag chosen by a person: never removed
    listings = []
    for step in range(4):
        _train(model, engine, rank, world_size, range(step, step + 1))
        engine.save_checkpoint(ckpt)
        torch.distributed.barrier()
        listings.append(sorted(os.listdir(ckpt)))
    return listings


@pytest.mark.parametrize("keep_last", KEEP_LAST)
def test_keep_last_removes_older_checkpoints_only_after_the_new_one_is_complete(runs, ckpts, keep_last):
    listings = runs.result(2, f"keep_last_{keep_last}")[0]
    steps = [f"global_step{i}" for i in range(1, 5)]
    for i, listing in enumerate(listings):
        kept = steps[:i + 1] if keep_last == 0 else steps[max(0, i + 1 - keep_last):i + 1]
        assert listing == sorted(kept + ["best", "latest"]), (i, listing)
    assert (ckpts / f"keep_last_{keep_last}" / "latest").read_text() == "global_step4"


def _resave_same_tag(rank, world_size, ckpt):
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(1))
    engine.save_checkpoint(ckpt, tag="same")
    _train(model, engine, rank, world_size, range(1, 2))
    engine.save_checkpoint(ckpt, tag="same")
    second = engine.full_state_dict()
    fresh_model = make_stateful_model(seed=5)
    fresh = zeroshard.initialize(fresh_model, _config(world_size, 2))
    fresh.load_checkpoint(ckpt)
    loaded = fresh.full_state_dict()
    return all(torch.equal(loaded[k], second[k]) for k in second), fresh.global_steps, sorted(os.listdir(ckpt))


def test_saving_an_existing_tag_again_replaces_it_whole(runs):
    for same, steps, listing in runs.result(2, "resave_same_tag"):
        assert same and steps == 2
        assert listing == ["latest", "same"]


def _unloadable_client_state(rank, world_size, ckpt):
    import argparse

    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(1))
    try:
        engine.save_checkpoint(ckpt, client_state={"args": argparse.Namespace(lr=1)})
        error = None
    except RuntimeError as e:
        error = str(e)
    published = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    engine.save_checkpoint(ckpt, client_state={"fine": 1})  # the engine is still usable
    return error, published


def test_a_client_state_that_would_not_load_back_fails_the_save_on_every_rank(runs):
    outcomes = runs.result(2, "unloadable_client_state")
    (error0, published), (error1, _) = outcomes
    assert "client_state cannot be saved" in error0 and "Namespace" in error0
    assert "failed on rank(s) 0" in error1 and "nothing was published" in error1
    assert [p for p in published if not p.startswith(".")] == []


def _client_state_unreadable_on_one_rank(rank, world_size, ckpt):
    """Saves, trains on, then loads while rank 1 cannot unpickle the client state (the load's
    callback sees torch.load fail there): every rank must fail, naming it, with nothing changed."""
    import contextlib
    from unittest import mock

    import torch

    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(1))
    engine.save_checkpoint(ckpt, client_state={"next_step": 1})
    _train(model, engine, rank, world_size, range(1, 2))
    before = engine.full_state_dict(dtype=torch.float32)
    steps = engine.global_steps
    refuse = mock.patch("torch.load", side_effect=ValueError("refused by the test"))
    try:
        with refuse if rank == 1 else contextlib.nullcontext():
            engine.load_checkpoint(ckpt)
        error = None
    except RuntimeError as e:
        error = str(e)
    after = engine.full_state_dict(dtype=torch.float32)
    unchanged = engine.global_steps == steps and all(torch.equal(before[k], after[k]) for k in before)
    _path, client_state = engine.load_checkpoint(ckpt)  # readable again: the same engine loads it
    return error, unchanged, client_state


def test_a_client_state_that_cannot_be_read_fails_the_load_on_every_rank_and_changes_nothing(runs):
    (error0, unchanged0, state0), (error1, unchanged1, state1) = runs.result(2, "unreadable_client_state")
    assert "client_state cannot be read: ValueError: refused by the test" in error1
    assert "failed on rank(s) 1" in error0 and "no rank changed anything" in error0
    assert unchanged0 and unchanged1
    assert state0 == state1 == {"next_step": 1}
