"""Checkpoints: a run saved at one world size and stage and loaded at another continues as if
it had never stopped; a save that dies leaves the previous checkpoint as it was; the weights
alone start a fine-tuning run. (Damaged files, another model's checkpoint, keep_last, client
state: test_checkpoint_directory.py; conversion to one file: test_convert.py.)

Each case runs real processes (Gloo) over a checkpoint directory of its own. The cases share
their spawned runs (spawn.SharedRuns, each case with its own result and failure): one per world
size that saves, then one per world size that resumes, in fresh processes, from what the first
ones saved. A rank killed while saving has its own.
"""

import functools
from pathlib import Path

import pytest
import torch

from checkpoint_runs import GLOBAL
from checkpoint_runs import config as _config
from checkpoint_runs import train as _train
from models import StatefulTransformer, global_batch, make_stateful_model
from spawn import SharedRuns, run_ranks
from training import LR, AdamWReference, no_decay_groups

SAVED_STEPS = 3     # steps before the checkpoint
RESUMED_STEPS = 3   # steps after it
RTOL, ATOL = 1e-4, 1e-5


def _save_and_continue(rank, world_size, ckpt, stage, precision, gas=1):
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


def _resume(rank, world_size, ckpt, stage, precision, gas=1):
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


@functools.cache  # every resharding case compares with the same run; callers only read it
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


SAME_CASES = [("fp32", 2, 1), ("bf16", 3, 1), ("fp16", 1, 1), ("fp32", 2, 2)]  # (precision, stage, gas)
# (saved at world size, stage) -> (loaded at world size, stage)
RESHARD_CASES = {
    "2_to_4_ranks": ((2, 1), (4, 1)),
    "4_to_2_ranks_stage2_to_stage3": ((4, 2), (2, 3)),
    "4_to_1_rank_stage3_to_stage0": ((4, 3), (1, 0)),
    "stage2_to_stage3": ((2, 2), (2, 3)),
    "1_rank_stage0_to_2_ranks_stage2": ((1, 0), (2, 2)),
}


def _same(precision, stage, gas):
    return f"same_{precision}_stage{stage}_gas{gas}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Where each case saves: ckpts / its name."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def saves(ckpts):
    cases = {1: {}, 2: {}, 4: {}}
    for precision, stage, gas in SAME_CASES:
        cases[2][_same(precision, stage, gas)] = (_save_and_continue, stage, precision, gas)
    for name, ((ws, stage), _) in RESHARD_CASES.items():
        cases[ws][name] = (_save_and_continue, stage, "fp32")
    cases[2]["fine_tune"] = (_fine_tune_from,)
    return SharedRuns({ws: {name: (fn, str(ckpts / name), *args) for name, (fn, *args) in by_name.items()}
                       for ws, by_name in cases.items()})


@pytest.fixture(scope="module")
def resumes(ckpts, saves):
    saves.run_all()  # every checkpoint is written before the first resume
    cases = {1: {}, 2: {}, 4: {}}
    for precision, stage, gas in SAME_CASES:
        cases[2][_same(precision, stage, gas)] = (_resume, stage, precision, gas)
    for name, (_, (ws, stage)) in RESHARD_CASES.items():
        cases[ws][name] = (_resume, stage, "fp32")
    return SharedRuns({ws: {name: (fn, str(ckpts / name), *args) for name, (fn, *args) in by_name.items()}
                       for ws, by_name in cases.items()})


@pytest.mark.parametrize("precision,stage,gas", SAME_CASES)
def test_resume_at_the_same_world_size_and_stage_is_bit_exact(saves, resumes, ckpts, precision, stage, gas):
    name = _same(precision, stage, gas)
    path, losses, state, steps, scale = saves.result(2, name)[0]
    assert Path(path) == ckpts / name / f"global_step{SAVED_STEPS}"
    loaded, client, resumed, resumed_state, resumed_steps, resumed_scale = resumes.result(2, name)[0]
    assert loaded == path and client == {"next_step": SAVED_STEPS, "note": "saved"}
    assert resumed == losses[SAVED_STEPS:]
    assert (resumed_steps, resumed_scale) == (steps, scale)
    assert resumed_state.keys() == state.keys()
    for name in state:
        assert torch.equal(resumed_state[name], state[name]), name


@pytest.mark.parametrize("case", sorted(RESHARD_CASES))
def test_resume_at_another_world_size_or_stage_continues_like_adamw(saves, resumes, case):
    (save_ws, _), (load_ws, _) = RESHARD_CASES[case]
    _, losses, state, _, _ = saves.result(save_ws, case)[0]
    _, _, resumed, resumed_state, resumed_steps, _ = resumes.result(load_ws, case)[0]
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


def test_load_without_optimizer_states_takes_only_the_weights(saves):
    saved, loaded, steps, lr, losses, final = saves.result(2, "fine_tune")[0]
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
