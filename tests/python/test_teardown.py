"""Dropping an engine or a Communicator never hangs, before or after destroy_process_group().

Once a script has called destroy_process_group(), the engine (or a zeroshard.Communicator) may
hold the last reference to the group: dropping it destroys the group, and ~ProcessGroupGloo
joins Gloo's worker threads. A worker may at that moment be destroying a finished barrier,
and with it the earlier collective the barrier waited for, whose tensor is Python-owned and
needs the GIL to be let go: the object must be destroyed without the GIL held, or the two
threads wait for each other forever (issue 12).

Each test repeats the script's shape, at 2 ranks, in the same two processes: a fresh group, a
holder (an engine at stage 1, 2 or 3, or a Communicator), a step or two of work, then the
teardown. The barrier is the script's own (waited for), or left in flight behind an all-reduce
of a Python tensor when the group is destroyed: a broken build deadlocks in the second almost
always, in the first now and then. Every iteration has a deadline: a rank that misses it dumps
every thread's stack into the failure message and exits.
"""

import faulthandler
import gc
from datetime import timedelta

import pytest
import torch

from models import make_model
from spawn import run_ranks
from training import engine_config, train_global_batches

WORLD_SIZE = 2
# Each holder with each barrier twice (once when the group outlives the holder: that order
# never hung). A broken build hangs in the first few iterations.
ITERATIONS_AFTER = 16
ITERATIONS_BEFORE = 8
ITERATION_LIMIT = 20.0  # seconds; an iteration takes well under one
HOLDERS = ("stage 1 engine", "stage 2 engine", "stage 3 engine", "Communicator")
BARRIERS = ("barrier waited", "barrier in flight")
STEPS = 2


def _make_holder(holder, rank, world_size):
    """The holder, after a step or two of work whose last collective is on a Python tensor."""
    import zeroshard

    if holder == "Communicator":
        comm = zeroshard.Communicator()
        t = torch.full((8,), float(rank + 1))
        comm.all_reduce(t)
        assert torch.equal(t, torch.full((8,), 3.0))
        return comm, None
    model = make_model()
    config = engine_config(int(holder.split()[1]), lr=1e-3, weight_decay=None, gas=1)
    engine = zeroshard.initialize(model, config, process_group=None)
    # train_global_batches all-reduces each step's loss (a Python tensor) with dist.all_reduce.
    train_global_batches(model, engine, rank, world_size, range(STEPS))
    assert engine.global_steps == STEPS
    return engine, model


def _barrier(kind):
    import torch.distributed as dist

    if kind == "barrier waited":
        dist.barrier()
    else:
        # Neither handle is kept: the barrier waits for the all-reduce (Gloo orders it after
        # every collective in flight), the Gloo worker holds the barrier's last reference, and
        # it finishes the barrier while the group is being destroyed.
        dist.all_reduce(torch.ones(4), async_op=True)
        dist.barrier(async_op=True)


def _teardown_loop(rank, world_size, log_dir, holder_first, iterations):
    """`iterations` times: a fresh group on one store, a holder, then the teardown: the holder
    dropped after the barrier and destroy_process_group() (holder_first False), or before."""
    import torch.distributed as dist
    import zeroshard  # noqa: F401  (imported before the first deadline)

    torch.set_num_threads(1)
    # One store for every iteration's group, kept by this function: run_ranks' group (and its
    # store) goes, so that each iteration's group is held only by torch.distributed and the holder.
    store_timeout = timedelta(seconds=ITERATION_LIMIT + 10)
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=store_timeout,
                              wait_for_workers=False)
    port = [store.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port[0], world_size, is_master=False, timeout=store_timeout)
    dist.destroy_process_group()

    with open(f"{log_dir}/rank{rank}.log", "w") as log:

        def note(line):  # what the rank was doing, above its stacks if it hangs
            log.write(line + "\n")
            log.flush()

        for i in range(iterations):
            holder = HOLDERS[(i // len(BARRIERS)) % len(HOLDERS)]
            barrier = BARRIERS[i % len(BARRIERS)]
            note(f"iteration {i}: {holder}, {barrier}, dropped "
                 f"{'before' if holder_first else 'after'} destroy_process_group()")
            # A rank that hangs writes every thread's stack to its log and exits.
            faulthandler.dump_traceback_later(ITERATION_LIMIT, exit=True, file=log)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"iteration{i}", store), rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=ITERATION_LIMIT + 10))
            obj, model = _make_holder(holder, rank, world_size)
            if holder_first:
                note("  dropping the holder")
                del obj, model
                gc.collect()
                note("  barrier, destroy_process_group()")
                _barrier(barrier)
                dist.destroy_process_group()
            else:
                note("  barrier, destroy_process_group()")
                _barrier(barrier)
                dist.destroy_process_group()
                assert dist.group.WORLD is None
                note("  dropping the holder, the group's last owner")
                del obj, model
                gc.collect()
            faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(ITERATION_LIMIT, exit=True)  # for the way out
    return iterations


def _run(tmp_path, holder_first, iterations):
    try:
        return run_ranks(_teardown_loop, WORLD_SIZE, str(tmp_path), holder_first, iterations,
                         timeout=iterations * ITERATION_LIMIT)
    except AssertionError as e:
        logs = [f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()}"
                for r in range(WORLD_SIZE) if (tmp_path / f"rank{r}.log").exists()]
        # A rank that hangs dumps its stacks and exits: its peer may fail first, on a lost peer.
        raise AssertionError("\n".join([str(e), "Each rank's log:", *logs])) from None


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks


def test_dropping_the_last_holder_of_a_destroyed_group_does_not_hang(tmp_path):
    """barrier, destroy_process_group(), then the engine or Communicator goes: the group goes
    with it, while a Gloo worker may still be letting go of the barrier's work."""
    assert _run(tmp_path, False, ITERATIONS_AFTER) == [ITERATIONS_AFTER] * WORLD_SIZE


def test_dropping_the_holder_before_destroy_process_group_does_not_hang(tmp_path):
    """The engine or Communicator goes first, then barrier and destroy_process_group():
    torch.distributed lets go of the group last."""
    assert _run(tmp_path, True, ITERATIONS_BEFORE) == [ITERATIONS_BEFORE] * WORLD_SIZE
