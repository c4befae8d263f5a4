"""Run a function on N real processes that share a Gloo process group.

Every multi-process test goes through run_ranks(): processes are started with the "spawn"
method, each joins a torch.distributed Gloo group on 127.0.0.1, and the parent waits for all
of them within a deadline. A failing rank's traceback is raised in the test; a hang becomes
a failure and every child is killed.

SharedRuns runs many cases in one spawn per world size (each spawned rank pays the interpreter,
the torch import and the group's setup, seconds on a small machine): each case keeps its own
result, and its own failure, named after it.
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


def _rank_main(fn, rank, world_size, port, timeout, deadline, args, results):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that hangs prints every thread's stack and exits, so the parent reports it.
    faulthandler.dump_traceback_later(deadline - 30, exit=True)
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


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, deadline=None, lingering_rank=None):
    """Runs fn(rank, world_size, *args) on world_size processes; returns results by rank.

    fn must be a module-level function (it is pickled). timeout bounds each collective;
    deadline (default timeout + 60) the whole run. A rank named by lingering_rank may never
    finish (it models a stalled peer): it is killed once every other rank reported.
    """
    deadline = timeout + 60 if deadline is None else deadline
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout, deadline, args, results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    expected = world_size - (1 if lingering_rank is not None else 0)
    outcomes = {}
    finished = False
    end = time.monotonic() + deadline
    try:
        while len(outcomes) < expected:
            remaining = end - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes) - {lingering_rank})
                raise AssertionError(f"ranks {missing} did not finish within {deadline:.0f}s")
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


def _run_cases(rank, world_size, cases, agreement_timeout):
    """On each rank: fn(rank, world_size, *args) for each (name, (fn, *args)) of cases, in order.
    Returns {name: ("ok", result) or ("error", traceback)}; a case missing was not run.

    After each case the ranks agree, over a group of their own, whether it failed anywhere; if
    so they stop. A rank that failed may have left its peers inside a collective of the main
    group (they see its timeout and fail too) or skipped one, so that group's collectives no
    longer pair up; the agreement's own group is never out of step."""
    import torch
    import torch.distributed as dist

    agreement = dist.new_group(backend="gloo", timeout=timedelta(seconds=agreement_timeout))
    outcomes = {}
    for name, (fn, *args) in cases:
        try:
            outcomes[name] = ("ok", fn(rank, world_size, *args))
        except Exception:  # the case's failure is its own; the next ones may still be run
            outcomes[name] = ("error", traceback.format_exc())
        failed = torch.tensor([int(outcomes[name][0] == "error")])
        dist.all_reduce(failed, group=agreement)
        if failed.item():
            break
    dist.destroy_process_group(agreement)
    return outcomes


class SharedRuns:
    """Many cases run in one spawn per world size.

    cases: {world_size: {name: (fn, *args)}}; fn(rank, world_size, *args), a module-level
    function as for run_ranks, runs on every rank of the world size's run, case after case in
    the order given, in one process per rank, so a case must build all it uses (seeds
    included) and leave no state behind. The run of a world size is spawned the first time one
    of its cases is asked for: result(world_size, name) returns that case's results by rank, or
    raises an AssertionError naming the case and every rank's traceback (or the earlier case
    whose failure stopped the run before it). timeout bounds each collective, as for
    run_ranks; the whole run gets timeout per case.
    """

    def __init__(self, cases, timeout=DEFAULT_TIMEOUT):
        self._timeout = timeout
        self._cases = {ws: list(by_name.items()) for ws, by_name in cases.items()}
        self._runs = {}

    def run_all(self):
        """Spawns the run of every world size not run yet; what failed is left to its cases."""
        for world_size, cases in self._cases.items():
            if world_size not in self._runs:
                self._run(world_size, cases)

    def _run(self, world_size, cases):
        deadline = self._timeout * len(cases) + 60
        try:
            self._runs[world_size] = run_ranks(_run_cases, world_size, cases, deadline,
                                               timeout=self._timeout, deadline=deadline)
        except AssertionError as e:  # every case of the run reports what stopped it
            self._runs[world_size] = AssertionError(
                f"the shared run of {len(cases)} cases at world size {world_size} failed:\n{e}")

    def result(self, world_size, name):
        cases = self._cases[world_size]
        assert name in dict(cases), f"no case {name!r} at world size {world_size}"
        if world_size not in self._runs:
            self._run(world_size, cases)
        run = self._runs[world_size]
        if isinstance(run, AssertionError):
            raise run
        if any(name not in outcomes for outcomes in run):
            stopped_by = next(n for n, (status, _) in run[0].items() if status == "error")
            raise AssertionError(f"case {name!r} at world size {world_size} was not run: case {stopped_by!r} "
                                 "failed before it in the same spawned run")
        # Every rank's traceback: the first rank's may only be the timeout that another's failure caused.
        errors = [f"--- rank {rank} ---\n{outcomes[name][1]}" for rank, outcomes in enumerate(run)
                  if outcomes[name][0] == "error"]
        if errors:
            raise AssertionError(f"case {name!r} failed at world size {world_size}:\n" + "\n".join(errors))
        return [outcomes[name][1] for outcomes in run]
