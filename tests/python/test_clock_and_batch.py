"""Checkpoints on a clock (zeroshard.checkpoint.every_minutes) and the batch guard
(zeroshard.batch_guard), at 2 ranks in one spawned run.

Clock: each rank's clock is replaced by a scripted one (engine._core._set_clock), rank 1's
always saying a save is due: the saves happen where rank 0's clock says, on both ranks, at the
first boundary every_minutes after the last save, with keep_last 2 and the client state of
clock_client_state(). No real time passes in the test.

Batch guard: a checkpoint saved at a global batch of 4 (2 per rank x 1 x 2 ranks), loaded with
8, 2 and 6: a warning on rank 0 only, naming both batches and the accumulation that keeps 4
(none for 6); with "error" the load fails on every rank and changes nothing.
"""

import os
import warnings

import pytest
import torch

from models import make_model
from spawn import SharedRuns
from training import engine_config, train_global_batches

WORLD = 2
# Rank 0's clock before each of the 7 steps (minutes): due at 31, 62 and 95 with every_minutes 30.
TIMES = [10, 20, 31, 40, 62, 70, 95]
SAVED_AFTER = {3: ["global_step3"], 5: ["global_step3", "global_step5"], 7: ["global_step5", "global_step7"]}


def _checkpoints(path):
    return sorted(n for n in os.listdir(path) if not n.startswith(".") and os.path.isdir(os.path.join(path, n))) \
        if os.path.isdir(path) else []


def _clock(rank, world_size, tmp):
    import zeroshard

    ckpt = f"{tmp}/clock"
    config = engine_config(1, zeroshard={"checkpoint": {"every_minutes": 30, "keep_last": 2, "dir": ckpt}})
    model = make_model()
    engine = zeroshard.initialize(model, config)
    now = [0.0]
    engine._core._set_clock(lambda: now[0] if rank == 0 else 1e9)
    engine.clock_client_state = lambda: {"step": engine.global_steps}
    seen = []
    for step, minutes in enumerate(TIMES, start=1):
        now[0] = float(minutes)
        train_global_batches(model, engine, rank, world_size, [step])
        torch.distributed.barrier()
        seen.append(_checkpoints(ckpt))
    _, client = engine.load_checkpoint(ckpt)
    return {"seen": seen, "latest": open(f"{ckpt}/latest").read().strip(), "client": client}


def _save(tmp, micro):
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, engine_config(2, micro=micro))
    train_global_batches(model, engine, torch.distributed.get_rank(), WORLD, [0], micro)
    return engine.save_checkpoint(f"{tmp}/batch")


def _load(tmp, micro, gas, guard):
    """Loads the checkpoint into a fresh engine; (warnings, error, weights changed)."""
    import zeroshard

    model = make_model(seed=3)
    config = engine_config(2, micro=micro, gas=gas, zeroshard={"batch_guard": guard})
    engine = zeroshard.initialize(model, config)
    before = engine.full_state_dict()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.load_checkpoint(f"{tmp}/batch")
        except RuntimeError as e:
            error = str(e)
    after = engine.full_state_dict()
    changed = any(not torch.equal(before[k], v) for k, v in after.items())
    return [str(w.message) for w in caught if "global batch" in str(w.message)], error, changed


def _batch(rank, world_size, tmp):
    _save(tmp, micro=2)
    return {name: _load(tmp, *args) for name, args in {
        "same": (1, 2, "warn"), "double": (2, 2, "warn"), "half": (1, 1, "warn"), "no_fit": (3, 1, "warn"),
        "error": (2, 2, "error")}.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("clock_and_batch"))
    return SharedRuns({WORLD: {"clock": (_clock, tmp), "batch": (_batch, tmp)}})


def test_rank0s_clock_decides_when_every_rank_saves(runs):
    for result in runs.result(WORLD, "clock"):
        for step, seen in enumerate(result["seen"], start=1):
            expected = SAVED_AFTER.get(step, SAVED_AFTER.get(step - 1, []))
            assert seen == expected, (step, result["seen"])
        assert result["latest"] == "global_step7"
        assert result["client"] == {"step": 7}


def test_the_same_global_batch_in_another_layout_is_quiet(runs):
    for warned, error, _ in [r["same"] for r in runs.result(WORLD, "batch")]:
        assert warned == [] and error is None


@pytest.mark.parametrize("case, new, keeps", [("double", "8 (2 per rank x 2 accumulation steps x 2 ranks)",
                                               "gradient_accumulation_steps 1 keeps the global batch of 4"),
                                              ("half", "2 (1 per rank x 1 accumulation step x 2 ranks)",
                                               "gradient_accumulation_steps 2 keeps the global batch of 4"),
                                              ("no_fit", "6 (3 per rank x 1 accumulation step x 2 ranks)",
                                               "no gradient_accumulation_steps keeps 4 at 3 per rank on 2 ranks")])
def test_another_global_batch_warns_once_on_rank0_naming_both(runs, case, new, keeps):
    rank0, rank1 = (r[case] for r in runs.result(WORLD, "batch"))
    assert len(rank0[0]) == 1 and rank1[0] == [], (rank0, rank1)
    message = rank0[0][0]
    assert "saved with a global batch of 4 (2 per rank x 1 accumulation step x 2 ranks)" in message, message
    assert f"resumed with {new}" in message and keeps in message, message
    assert rank0[1] is None and rank0[2], "the load went on and took the weights"


def test_batch_guard_error_fails_every_rank_and_changes_nothing(runs):
    for warned, error, changed in [r["error"] for r in runs.result(WORLD, "batch")]:
        assert error is not None and "zeroshard.batch_guard is \"error\"" in error, error
        assert "saved with a global batch of 4" in error and "resumed with 8" in error, error
        assert not changed and warned == []


def test_the_main_job_saves_on_the_clock_and_resumes_from_it(tmp_path):
    """examples/train_gpt.py --save-every-minutes with a clock so short that every step is due:
    the clock saves happen inside engine.step() with the job's client state (its step and data
    position), keep_last 2 holds, and --resume goes on from the last one."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ckpt = tmp_path / "ckpt"

    def job(*args):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(root / "examples" / "train_gpt.py"), "--steps", "3", "--seq", "16", "--log-every", "1",
                   "--save-dir", str(ckpt), "--save-every-minutes", "1e-9", *args]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=240,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout

    job()
    assert _checkpoints(ckpt) == ["global_step2", "global_step3"]
    resumed = job("--resume", "--steps", "4")
    assert "at step 4" in resumed and "step     4" in resumed, resumed
    assert _checkpoints(ckpt) == ["global_step3", "global_step4"]
