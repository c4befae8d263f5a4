"""A dead peer: one rank of a zeroshard job dies in the middle of a forward, of a backward (its
last layers' bucket reductions under way) or of a checkpoint save (dead_peer_job.py). Every
surviving rank must raise, not hang: within the collective timeout plus a margin of the death,
with zeroshard's error naming the collective (or the save), the rank it ran on and the bucket
whose gradient reduction or stage-3 unit whose gather it was (its parameters), and the rank that
is missing (zeroshard/peers.py asks the store which ranks are alive), and exit non-zero (so torchrun would tear the job down); none gets past the step. Stages 1-3 at 2 ranks
at every point, at 4 ranks a point per stage, and at 3 ranks the death of rank 0, whose process
serves the store. The ranks are plain processes (no torchrun,
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

# (world size, stage, where the victim dies, the victim's rank)
CASES = [(2, stage, point, 1) for stage in (1, 2, 3) for point in ("forward", "backward", "save")] + [
    (4, 0, "backward", 1), (4, 1, "save", 1), (4, 2, "backward", 1), (4, 3, "forward", 1),
    # Rank 0's process serves the store without torchrun: the survivors cannot count each other.
    (3, 2, "backward", 0)]


@pytest.mark.parametrize("world,stage,point,victim", CASES)
def test_the_survivors_of_a_dead_rank_raise_a_named_error_and_exit(tmp_path, world, stage, point, victim):
    port = free_port()
    command = [sys.executable, str(JOB), str(stage), point, str(victim), str(TIMEOUT), str(tmp_path)]
    envs = [dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world)]
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    results, _ = run_launchers([command] * world, logs, TIMEOUT + MARGIN + 60, envs)
    assert (tmp_path / "died").exists(), report(results)
    died = float((tmp_path / "died").read_text())
    how = signal.SIGXFSZ if point == "save" else signal.SIGKILL
    assert results[victim][0] == -how, report(results)
    for rank, (code, output) in enumerate(results):
        if rank == victim:
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
        # The missing rank, from the census in the store (zeroshard/peers.py): the only other
        # one at 2 ranks; else the ranks that did not report alive, the victim among them, or,
        # when the victim served the store, that its process is gone.
        if world == 2:
            missing = re.search(rf"\[rank {victim} \(the only other rank\) stopped answering", output)
            assert missing, f"rank {rank}'s error does not name rank {victim}:\n{output[-4000:]}"
        elif victim == 0:
            assert re.search(r"\[the job's store, served by rank 0's process, is unreachable too \(\w+\): that "
                             r"process has exited or died", output), output[-4000:]
        else:
            missing = re.search(rf"\[ranks? ([\d, ]+) of {world} did not report alive within", output)
            assert missing and str(victim) in missing.group(1).split(", "), \
                f"rank {rank}'s error does not name rank {victim}:\n{output[-4000:]}"
