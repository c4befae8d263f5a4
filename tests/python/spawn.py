"""Run a function on N real processes that share a Gloo process group.

Every multi-process test goes through run_ranks(): processes are started with the "spawn"
method, each joins a torch.distributed Gloo group on 127.0.0.1, and the parent waits for all
of them within a deadline. A failing rank's traceback is raised in the test; a hang becomes
a failure and every child is killed.
"""

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import multiprocessing as mp

DEFAULT_TIMEOUT = 90.0


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, timeout, args, results):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that hangs prints every thread's stack and exits, so the parent reports it.
    faulthandler.dump_traceback_later(timeout + 30, exit=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        # Plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, lingering_rank=None):
    """Runs fn(rank, world_size, *args) on world_size processes; returns results by rank.

    fn must be a module-level function (it is pickled). A rank named by lingering_rank may
    never finish (it models a stalled peer): it is killed once every other rank reported.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    expected = world_size - (1 if lingering_rank is not None else 0)
    outcomes = {}
    finished = False
    deadline = time.monotonic() + timeout + 60
    try:
        while len(outcomes) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes) - {lingering_rank})
                raise AssertionError(f"ranks {missing} did not finish within {timeout + 60:.0f}s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outcomes and r != lingering_rank and p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise AssertionError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
            outcomes[rank] = pickle.loads(payload)
        finished = True
    finally:
        # Ranks that reported get time to leave the group; after a failure the others may be
        # stuck in a collective, so they are killed quickly.
        for r, p in enumerate(procs):
            if r != lingering_rank:
                p.join(timeout=30 if finished else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outcomes.get(r) for r in range(world_size)]
