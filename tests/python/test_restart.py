"""Restart and resume: the main job, examples/train_gpt.py, under `torchrun --max-restarts 1` with
`--resume auto`, a rank killed mid-run after a checkpoint exists.

Held to: torchrun restarts the job, it resumes from the last complete checkpoint (global_step2)
and ends with the losses (from the resume point on) and the final weights, bitwise, of a run
that was never interrupted (the checkpoint holds the job's step and its batch generator's state,
so the uninterrupted run is the reference). The same when rank 1 dies inside a save, with rank 0
in it: that save is never `latest`, its staging directory is not taken for a checkpoint, and the
next save replaces it.

The kills need no timing: the job's test-only flags make rank 1, on torchrun's first attempt
only (TORCHELASTIC_RESTART_COUNT), SIGKILL itself in step 3 after its forward, or die by SIGXFSZ
at the first write of its shard file in the save of step 4 (fault_injection in the job). Every
run has a deadline on which its launcher and workers are killed (launchers.py). Three runs of 2
ranks, two of them started twice: ~70 s on 2 cores.
"""

import json

import pytest
import torch

from launchers import free_port, launcher_command, report, run_launchers
from zeroshard.convert import convert

STEPS, SEQ, SAVE_EVERY = 4, 32, 2
RUN_TIMEOUT = 240  # an attempt takes ~12 s on 2 cores


def _job(work, *extra):
    """The job in `work` (its checkpoints in work/ckpt), to the end: (summary, weights of the final
    checkpoint, output)."""
    work.mkdir()
    args = ["--steps", str(STEPS), "--seq", str(SEQ), "--log-every", "1", "--save-dir", str(work / "ckpt"),
            "--save-every", str(SAVE_EVERY), "--resume", "auto", "--summary", str(work / "summary.json"), *extra]
    command = launcher_command(1, 2, free_port(), args, max_restarts=1)
    results, _ = run_launchers([command], [work / "launcher.log"], RUN_TIMEOUT)
    code, output = results[0]
    assert code == 0, report(results)
    assert (work / "ckpt" / "latest").read_text() == f"global_step{STEPS}", report(results)
    convert(work / "ckpt", work / "weights.pt")
    return json.loads((work / "summary.json").read_text()), torch.load(work / "weights.pt"), output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    summary, weights, output = _job(tmp_path_factory.mktemp("restart") / "uninterrupted")
    assert "--resume auto: no checkpoint in" in output and "starting fresh" in output, output
    assert "resumed from" not in output and output.count("zeroshard stage") == 1, output
    assert sorted(summary["losses"], key=int) == [str(s) for s in range(1, STEPS + 1)]
    return summary, weights


def _assert_resumed_as_uninterrupted(run, uninterrupted, how_rank_1_died):
    summary, weights, output = run
    assert f"(exitcode: {how_rank_1_died}) local_rank: 1" in output, output
    assert output.count("zeroshard stage") == 2, f"no restart:\n{output}"
    assert "/global_step2 at step 3" in output.split("resumed from ", 1)[-1].splitlines()[0], output
    # The restarted attempt logged steps 3 and 4 (the first attempt's summary died with it).
    reference_summary, reference_weights = uninterrupted
    assert summary["losses"] == {s: reference_summary["losses"][s] for s in ("3", "4")}, output
    assert weights.keys() == reference_weights.keys()
    different = [name for name, value in reference_weights.items() if not torch.equal(weights[name], value)]
    assert not different, f"final weights differ from the uninterrupted run's: {different}"


def test_a_rank_killed_mid_step_restarts_from_the_last_checkpoint_and_ends_as_if_never_killed(
        tmp_path, uninterrupted):
    run = _job(tmp_path / "killed", "--test-kill-at-step", "3")
    _assert_resumed_as_uninterrupted(run, uninterrupted, "-9")  # SIGKILL
    assert "unfinished save" not in run[2], run[2]


def test_a_save_a_rank_died_in_is_never_latest_and_the_restart_resumes_from_the_one_before(
        tmp_path, uninterrupted):
    run = _job(tmp_path / "killed_in_save", "--test-kill-in-save", "4")
    _assert_resumed_as_uninterrupted(run, uninterrupted, "-25")  # SIGXFSZ, in its first write of the save
    output = run[2]
    # Rank 0 had made the save's staging directory before rank 1 died writing its file into it:
    # the restart saw it, did not take it for a checkpoint, and the next save replaced it.
    assert f"not checkpoints: .staging-global_step4\n" in output, output
    assert sorted(p.name for p in (tmp_path / "killed_in_save" / "ckpt").iterdir()) == [
        "global_step2", "global_step4", "latest"]
