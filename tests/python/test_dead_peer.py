"""A dead peer: one rank of a zeroshard job dies in the middle of a forward, of a backward (its
last layers' bucket reductions under way) or of a checkpoint save (dead_peer_job.py). Every
surviving rank must raise, not hang: within the collective timeout plus a margin of the death,
with zeroshard's error naming the collective (or the save), the rank it ran on and the bucket
whose gradient reduction or stage-3 unit whose gather it was (its parameters), and exit
non-zero (so torchrun would tear the job down); none gets past the step. Stages 1-3 at 2 ranks
at every point, and at 4 ranks a point per stage. The ranks are plain processes (no torchrun,
whose agent would SIGTERM the survivors before they can show their own error). On Gloo a dead
peer's sockets close, so the survivors fail at once, far inside the timeout."""

import re
import signal
import sys
from pathlib import Path

import pytest

from launchers import free_port, report, run_launchers

JOB = Path(__file__).with_name("dead_peer_job.py")
TIMEOUT = 10.0  # the job's collective_timeout_seconds
MARGIN = 60.0  # process exit on a loaded 2-core machine
VICTIM = 1

CASES = [(2, stage, point) for stage in (1, 2, 3) for point in ("forward", "backward", "save")] + [
    (4, 0, "backward"), (4, 1, "save"), (4, 2, "backward"), (4, 3, "forward")]


@pytest.mark.parametrize("world,stage,point", CASES)
def test_the_survivors_of_a_dead_rank_raise_a_named_error_and_exit(tmp_path, world, stage, point):
    port = free_port()
    command = [sys.executable, str(JOB), str(stage), point, str(VICTIM), str(TIMEOUT), str(tmp_path)]
    envs = [dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world)]
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    results, _ = run_launchers([command] * world, logs, TIMEOUT + MARGIN + 60, envs)
    assert (tmp_path / "died").exists(), report(results)
    died = float((tmp_path / "died").read_text())
    how = signal.SIGXFSZ if point == "save" else signal.SIGKILL
    assert results[VICTIM][0] == -how, report(results)
    for rank, (code, output) in enumerate(results):
        if rank == VICTIM:
            continue
        assert code is not None, f"rank {rank} hung:\n{report(results)}"
        assert code != 0 and not (tmp_path / f"rank{rank}.done").exists(), report(results)
        ended = logs[rank].stat().st_mtime
        assert ended - died <= TIMEOUT + MARGIN, f"rank {rank} took {ended - died:.0f} s\n{report(results)}"
        if point == "save":
            named = re.search(rf"RuntimeError: zeroshard checkpoint: saving '[^']*global_step2' failed", output)
        else:
            named = re.search(rf"RuntimeError: zeroshard: (all_gather|reduce_scatter|all_reduce|broadcast) of "
                              rf"\d+ bytes \(\d+ x \w+\) on rank {rank} of {world} \(gloo\) failed", output)
        assert named, f"rank {rank}'s error names no collective:\n{output[-4000:]}"
        if point == "save":  # a rank that stopped answering in the save's agreement
            where = re.search(r"failed: another rank stopped answering \(zeroshard: \w+ of ", output)
        else:  # the bucket whose reduction or the unit whose gather failed, with its parameters
            where = re.search(r"\[(reducing the gradients of bucket \d+ of \d+|gathering the parameters of "
                              r"stage-3 unit \d+ of 4 [a-z ]+): '\d\.(weight|bias)'", output)
        assert where, f"rank {rank}'s error names no bucket or unit:\n{output[-4000:]}"
