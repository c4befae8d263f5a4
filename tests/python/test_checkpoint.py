"""Checkpoints: a run saved at one world size and stage and loaded at another continues as if
it had never stopped; a save that dies leaves the previous checkpoint as it was; damaged files
are errors that name them. (Conversion to one file: test_convert.py.)

Each case runs real processes (Gloo) over one checkpoint directory under pytest's tmp_path.
"""

import os
import re
from pathlib import Path

import pytest
import torch

from checkpoint_runs import GLOBAL
from checkpoint_runs import config as _config
from checkpoint_runs import damage as _damage
from checkpoint_runs import train as _train
from models import StatefulTransformer, global_batch, make_stateful_model
from spawn import run_ranks
from training import LR, AdamWReference, no_decay_groups

SAVED_STEPS = 3     # steps before the checkpoint
RESUMED_STEPS = 3   # steps after it
RTOL, ATOL = 1e-4, 1e-5


def _save_and_continue(rank, world_size, stage, precision, ckpt, gas=1):
    """The uninterrupted run: trains, saves after SAVED_STEPS, and goes on training."""
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, stage, precision, gas))
    losses = _train(model, engine, rank, world_size, range(SAVED_STEPS))
    traffic = engine.comm_stats()
    # As a scheduler would: the checkpoint must carry this lr, not the config's.
    engine.set_lr(LR * 0.5)
    path = engine.save_checkpoint(ckpt, client_state={"next_step": SAVED_STEPS, "note": "saved"})
    losses += _train(model, engine, rank, world_size, range(SAVED_STEPS, SAVED_STEPS + 1))
    # The save's own collectives are not counted as the next step's traffic.
    assert engine.comm_stats() == traffic, (engine.comm_stats(), traffic)
    losses += _train(model, engine, rank, world_size, range(SAVED_STEPS + 1, SAVED_STEPS + RESUMED_STEPS))
    state = engine.full_state_dict()
    return (path, losses, state, engine.global_steps, engine.loss_scale) if rank == 0 else None


def _resume(rank, world_size, stage, precision, ckpt, gas=1):
    """A fresh process with a differently initialized model: loads, then trains on."""
    import zeroshard

    model = make_stateful_model(seed=1234)
    engine = zeroshard.initialize(model, _config(world_size, stage, precision, gas))
    path, client_state = engine.load_checkpoint(ckpt)
    assert engine.get_lr() == LR * 0.5
    start = client_state["next_step"]
    losses = _train(model, engine, rank, world_size, range(start, start + RESUMED_STEPS))
    state = engine.full_state_dict()
    return (path, client_state, losses, state, engine.global_steps, engine.loss_scale) if rank == 0 else None


def _reference():
    """Single-process torch.optim.AdamW over every step on the whole global batch."""
    model = make_stateful_model(0)
    reference = AdamWReference(model)
    losses = []
    for step in range(SAVED_STEPS + RESUMED_STEPS):
        if step == SAVED_STEPS:
            reference.set_lr(LR * 0.5)
        losses.append(reference.step(global_batch(step, GLOBAL)))
        model.advance()
    return losses, model.state_dict()


@pytest.mark.parametrize("precision,stage,gas", [("fp32", 2, 1), ("bf16", 3, 1), ("fp16", 1, 1), ("fp32", 2, 2)])
def test_resume_at_the_same_world_size_and_stage_is_bit_exact(tmp_path, precision, stage, gas):
    path, losses, state, steps, scale = run_ranks(_save_and_continue, 2, stage, precision, str(tmp_path), gas)[0]
    assert Path(path) == tmp_path / f"global_step{SAVED_STEPS}"
    loaded, client, resumed, resumed_state, resumed_steps, resumed_scale = run_ranks(
        _resume, 2, stage, precision, str(tmp_path), gas)[0]
    assert loaded == path and client == {"next_step": SAVED_STEPS, "note": "saved"}
    assert resumed == losses[SAVED_STEPS:]
    assert (resumed_steps, resumed_scale) == (steps, scale)
    assert resumed_state.keys() == state.keys()
    for name in state:
        assert torch.equal(resumed_state[name], state[name]), name


# (saved at world size, stage) -> (loaded at world size, stage)
RESHARD_CASES = {
    "2_to_4_ranks": ((2, 1), (4, 1)),
    "4_to_2_ranks_stage2_to_stage3": ((4, 2), (2, 3)),
    "4_to_1_rank_stage3_to_stage0": ((4, 3), (1, 0)),
    "stage2_to_stage3": ((2, 2), (2, 3)),
    "1_rank_stage0_to_2_ranks_stage2": ((1, 0), (2, 2)),
}


@pytest.mark.parametrize("case", sorted(RESHARD_CASES))
def test_resume_at_another_world_size_or_stage_continues_like_adamw(tmp_path, case):
    (save_ws, save_stage), (load_ws, load_stage) = RESHARD_CASES[case]
    _, losses, state, _, _ = run_ranks(_save_and_continue, save_ws, save_stage, "fp32", str(tmp_path))[0]
    _, _, resumed, resumed_state, resumed_steps, _ = run_ranks(_resume, load_ws, load_stage, "fp32", str(tmp_path))[0]
    ref_losses, ref_state = _reference()
    assert resumed_steps == SAVED_STEPS + RESUMED_STEPS
    assert resumed == pytest.approx(ref_losses[SAVED_STEPS:], rel=1e-5)
    assert resumed == pytest.approx(losses[SAVED_STEPS:], rel=1e-5)
    assert resumed_state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(resumed_state[name], ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(resumed_state[name], state[name], rtol=RTOL, atol=ATOL)


def _save_then_die(rank, world_size, ckpt):
    """Saves `good`, trains a step, then saves `bad` with rank 1 killed by the kernel part way
    through writing its shard file (SIGXFSZ past a file-size limit, which is a real kill:
    the process runs no more code)."""
    import resource
    import signal

    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(2))
    engine.save_checkpoint(ckpt, tag="good")
    good = engine.full_state_dict()
    _train(model, engine, rank, world_size, range(2, 3))
    if rank == 1:
        shard_file = Path(ckpt) / "good" / "rank_00001.safetensors"
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it by default
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard_file.stat().st_size // 2,) * 2)
    try:
        engine.save_checkpoint(ckpt, tag="bad")
    except RuntimeError as e:
        return good, str(e)
    return good, None


def _load_and_save_again(rank, world_size, ckpt):
    import zeroshard

    model = make_stateful_model(seed=99)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    path, _ = engine.load_checkpoint(ckpt)
    state = engine.full_state_dict()
    engine.save_checkpoint(ckpt, tag="after")
    return path, state


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_intact_and_latest(tmp_path):
    outcomes = run_ranks(_save_then_die, 2, str(tmp_path), lingering_rank=1)
    good, error = outcomes[0]
    assert error is not None and "saving" in error, error
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    assert (tmp_path / ".staging-bad").exists()  # what the dead save left, never taken as a checkpoint

    path, state = run_ranks(_load_and_save_again, 2, str(tmp_path))[0]
    assert Path(path) == tmp_path / "good"
    for name in good:
        assert torch.equal(state[name], good[name]), name
    # The next save cleans up after the dead one.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after", "good", "latest"]


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


def test_a_flipped_byte_a_truncated_file_and_a_missing_file_each_name_the_file(tmp_path):
    damages = {
        "flipped": ("rank_00000.safetensors", "flip"),
        "truncated": ("rank_00000.safetensors", "truncate"),
        "missing": ("rank_00000.safetensors", "remove"),
        "manifest_flipped": ("manifest.json", "flip"),
        "manifest_missing": ("manifest.json", "remove"),
        "module_state_flipped": ("module_state.safetensors", "flip"),
    }
    errors, unchanged = run_ranks(_damaged_loads, 1, str(tmp_path), damages)[0]
    assert unchanged, "a failed load changed the engine"
    assert "checksum mismatch in" in errors["flipped"] and "rank_00000.safetensors" in errors["flipped"]
    assert "truncated" in errors["truncated"] and "rank_00000.safetensors" in errors["truncated"]
    assert "missing" in errors["missing"] and "rank_00000.safetensors" in errors["missing"]
    assert "manifest" in errors["manifest_flipped"] and "manifest.json" in errors["manifest_flipped"]
    assert "manifest.json' is missing" in errors["manifest_missing"]
    assert "checksum mismatch in" in errors["module_state_flipped"]
    assert "module_state.safetensors" in errors["module_state_flipped"]


def test_damage_seen_by_one_rank_fails_the_load_on_every_rank_and_changes_nothing(tmp_path):
    damages = {"flipped": ("rank_00001.safetensors", "flip")}
    outcomes = run_ranks(_damaged_loads, 2, str(tmp_path), damages)
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


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    shape_error = run_ranks(_load_into_other_model, 1, str(tmp_path / "a"), "shape")[0]
    # dim 32 instead of 24: whichever parameter is checked first is named with both shapes.
    assert re.search(r"parameter '[\w.]+' has shape \[[\d, ]*32[\d, ]*\] here but \[[\d, ]*24[\d, ]*\] "
                     r"in checkpoint 'global_step1'", shape_error), shape_error
    names_error = run_ranks(_load_into_other_model, 1, str(tmp_path / "b"), "names")[0]
    assert "'head.weight'" in names_error and "another model" in names_error
    dtype_error = run_ranks(_load_into_other_model, 1, str(tmp_path / "c"), "buffer_dtype")[0]
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


@pytest.mark.parametrize("keep_last", [2, 0])
def test_keep_last_removes_older_checkpoints_only_after_the_new_one_is_complete(tmp_path, keep_last):
    listings = run_ranks(_save_repeatedly, 2, str(tmp_path), keep_last)[0]
    steps = [f"global_step{i}" for i in range(1, 5)]
    for i, listing in enumerate(listings):
        kept = steps[:i + 1] if keep_last == 0 else steps[max(0, i + 1 - keep_last):i + 1]
        assert listing == sorted(kept + ["best", "latest"]), (i, listing)
    assert (tmp_path / "latest").read_text() == "global_step4"


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


def test_saving_an_existing_tag_again_replaces_it_whole(tmp_path):
    for same, steps, listing in run_ranks(_resave_same_tag, 2, str(tmp_path)):
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


def test_a_client_state_that_would_not_load_back_fails_the_save_on_every_rank(tmp_path):
    outcomes = run_ranks(_unloadable_client_state, 2, str(tmp_path))
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


def test_a_client_state_that_cannot_be_read_fails_the_load_on_every_rank_and_changes_nothing(tmp_path):
    (error0, unchanged0, state0), (error1, unchanged1, state1) = run_ranks(
        _client_state_unreadable_on_one_rank, 2, str(tmp_path))
    assert "client_state cannot be read: ValueError: refused by the test" in error1
    assert "failed on rank(s) 1" in error0 and "no rank changed anything" in error0
    assert unchanged0 and unchanged1
    assert state0 == state1 == {"next_step": 1}


def _fine_tune_from(rank, world_size, ckpt):
    """Saves at stage 2; then another run (stage 3, two param groups, a tenth of the lr) takes
    only the weights and trains one step."""
    import zeroshard

    model = make_stateful_model(0)
    engine = zeroshard.initialize(model, _config(world_size, 2))
    _train(model, engine, rank, world_size, range(SAVED_STEPS))
    engine.save_checkpoint(ckpt)
    saved = engine.full_state_dict()

    tuned_model = make_stateful_model(seed=7)
    config = _config(world_size, 3)
    config["optimizer"]["params"]["lr"] = LR / 10
    tuned = zeroshard.initialize(tuned_model, config, param_groups=no_decay_groups(tuned_model, 2e-3))
    tuned.load_checkpoint(ckpt, load_optimizer_states=False)
    loaded = tuned.full_state_dict()
    steps, lr = tuned.global_steps, tuned.get_lr()
    losses = _train(tuned_model, tuned, rank, world_size, range(SAVED_STEPS, SAVED_STEPS + 1))
    final = tuned.full_state_dict()
    return (saved, loaded, steps, lr, losses, final) if rank == 0 else None


def test_load_without_optimizer_states_takes_only_the_weights(tmp_path):
    saved, loaded, steps, lr, losses, final = run_ranks(_fine_tune_from, 2, str(tmp_path))[0]
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
    assert steps == 0 and lr == LR / 10
    # From here it is a fresh AdamW on the loaded weights.
    model = StatefulTransformer()
    model.load_state_dict(saved)
    reference = AdamWReference(model, lr=LR / 10, groups=no_decay_groups(model, 2e-3))
    loss = reference.step(global_batch(SAVED_STEPS, GLOBAL))
    model.advance()
    assert losses == pytest.approx([loss], rel=1e-5)
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(final[name], ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
