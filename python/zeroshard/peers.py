"""Which rank is missing, after a collective failed (issue 19, "A dead peer").

Gloo and NCCL say only that a peer's connection closed (an address and a port, no rank). The job
still has its store (torchrun's agent serves it, or rank 0 without torchrun), so after a failure
each surviving rank writes that it is alive and reads, for up to the collective timeout (at most
30 s) after the first failure, which ranks wrote too:
the ones that did not are the dead rank(s), or ranks still blocked in a collective that has not
failed for them yet. The error then says so, and which rank's log holds the cause.

Note [census after a failure]: every rank that fails takes part once per failure, in the
census numbered by how many failures this process has seen, so the ranks of one job meet in the
same keys without a collective (there is none left to use). The first rank to fail starts the
clock; every rank waits until all ranks have reported or until the collective timeout (at most
CENSUS_CAP_SECONDS) plus a margin after that first failure: a rank blocked in a collective that
does not touch the dead rank fails only at its timeout, and is counted then. So every survivor
still raises within the collective timeout plus the margin (rank 0 without torchrun one margin
more: its process serves the store, so it stays until the others have read their answer).
With 2 ranks there is nothing to ask: the other one is the peer. If the store itself is gone,
the process that served it is named."""

import functools
import os
import re
import time

import torch.distributed as dist

# The census waits for the other ranks until this long after the first failure: the collective
# timeout (a rank blocked in a collective that does not touch the dead one fails only then), at
# most CENSUS_CAP_SECONDS, plus a margin.
CENSUS_CAP_SECONDS = 30.0
CENSUS_MARGIN_SECONDS = 2.0
_POLL_SECONDS = 0.05
# The messages of zeroshard's collective errors (comm/communicator.cpp rethrowWithContext) and
# of a save or load whose agreement lost a rank (checkpoint/engine_checkpoint*.cpp).
_PEER_FAILURE = re.compile(r"\((gloo|nccl)\) failed|another rank stopped answering")
_failures = 0


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def census(timeout_seconds):
    """The ranks that did not report alive by the census's deadline, as a sentence; None when
    there is no process group or every rank reported."""
    global _failures
    if not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        return f"rank {1 - rank} (the only other rank) stopped answering; its log has the cause"
    store = _store()
    if store is None:
        return None
    _failures += 1
    prefix = f"zeroshard/census/{_failures}/"
    agent = "TORCHELASTIC_RUN_ID" in os.environ
    served_by = "torchrun's agent" if agent else "rank 0's process"
    window = min(timeout_seconds, CENSUS_CAP_SECONDS) + CENSUS_MARGIN_SECONDS
    try:
        # The first rank to fail starts the clock (wall time: the ranks may be on several machines).
        first = float(store.compare_set(prefix + "first", "", repr(time.time())))
        deadline = time.monotonic() + max(0.0, first + window - time.time())
        store.set(prefix + str(rank), "alive")
        present = _wait_for(store, prefix, world, deadline)
        store.set(prefix + f"read/{rank}", "1")
        if rank == 0 and not agent:
            # This process serves the store: it stays until the ranks it saw have read their
            # answer (or one more margin), so that its exit does not cut their census short.
            _wait_for(store, prefix + "read/", world, time.monotonic() + CENSUS_MARGIN_SECONDS, expect=present)
    except (RuntimeError, ValueError) as e:  # the store's connection failed: its server is gone
        return (f"the job's store, served by {served_by}, is unreachable too ({type(e).__name__}): that process "
                "has exited or died; the first rank to fail has the cause in its log")
    missing = sorted(set(range(world)) - present)
    if not missing:
        return None
    names = ", ".join(map(str, missing))
    return (f"rank{'s' if len(missing) > 1 else ''} {names} of {world} did not report alive within {window:g} s "
            "of the first failure (dead, or still waiting in a collective); the first of them to die has the cause "
            "in its log")


def _wait_for(store, prefix, world, deadline, expect=None):
    """The ranks r with key prefix + r in the store, once all of `expect` (default: every rank)
    are, or at `deadline` (time.monotonic())."""
    expect = set(range(world)) if expect is None else expect
    while True:
        present = {r for r in range(world) if store.check([prefix + str(r)])}
        if expect <= present or time.monotonic() >= deadline:
            return present
        time.sleep(_POLL_SECONDS)


def names_missing_ranks(method):
    """Adds census() to a RuntimeError from a collective that lost a peer (an Engine method)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except RuntimeError as e:
            # Once per failure: a method called inside another (a save on the clock in step)
            # leaves the census to the innermost.
            if getattr(e, "_zeroshard_census", False) or not _PEER_FAILURE.search(str(e)):
                raise
            found = census(args[0].config.zeroshard.collective_timeout_seconds)
            if found is None:
                raise
            named = RuntimeError(f"{e} [{found}]")
            named._zeroshard_census = True
            raise named from e

    return wrapper
