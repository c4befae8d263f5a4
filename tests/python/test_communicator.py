"""The communicator through the Python binding, on real Gloo groups of 1, 2 and 4 ranks (one
spawned run per world size, spawn.SharedRuns, each case with its own result and failure)."""

import pytest
import torch

from conftest import WORLD_SIZES
from spawn import SharedRuns, run_ranks


@pytest.fixture(scope="module")
def runs():
    cases = {ws: {"collectives": (_collectives,)} for ws in WORLD_SIZES}
    cases[4]["subgroup"] = (_subgroup,)
    return SharedRuns(cases)


def _collectives(rank, world_size):
    import zeroshard

    comm = zeroshard.Communicator()
    assert (comm.rank, comm.world_size) == (rank, world_size)
    w = world_size

    flat = torch.empty(3 * w)
    comm.all_gather(torch.full((3,), rank + 1.0), flat)
    assert torch.equal(flat, torch.arange(1, w + 1, dtype=torch.float32).repeat_interleave(3))

    inp = torch.arange(4 * w, dtype=torch.float32) + rank
    shard = torch.empty(4)
    comm.reduce_scatter(inp, shard, scale=1.0 / w)
    expected = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + (w - 1) / 2.0
    assert torch.allclose(shard, expected), (shard, expected)

    # Two collectives in flight at once, waited on in the opposite order.
    t = torch.full((5,), float(rank))
    b = torch.full((6,), float(rank))
    h1 = comm.all_reduce(t, async_op=True)
    h2 = comm.broadcast(b, w - 1, async_op=True)
    # A group of one has nothing to exchange: its collectives are done when they return (Note [a
    # group of one], comm/communicator.cpp), still counted below.
    assert (h1.pending and h2.pending) == (w > 1), (w, h1.pending, h2.pending)
    h2.wait()
    h1.wait()
    assert not h1.pending
    assert torch.equal(t, torch.full((5,), w * (w - 1) / 2.0))
    assert torch.equal(b, torch.full((6,), w - 1.0))

    stats = comm.stats()
    assert stats["all_gather"] == {"calls": 1, "bytes": 3 * w * 4}
    assert stats["reduce_scatter"] == {"calls": 1, "bytes": 4 * w * 4}
    assert stats["all_reduce"] == {"calls": 1, "bytes": 20}
    assert stats["broadcast"] == {"calls": 1, "bytes": 24}
    assert stats["traffic_bytes"] == 3 * w * 4 + 4 * w * 4 + 2 * 20 + 24
    comm.reset_stats()
    assert comm.stats()["traffic_bytes"] == 0

    with pytest.raises(RuntimeError, match="flat buffer has 7 elements"):
        comm.all_gather(torch.zeros(2), torch.empty(7))
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives_values_and_bytes(runs, world_size):
    assert runs.result(world_size, "collectives") == [True] * world_size


def _subgroup(rank, world_size):
    import torch.distributed as dist
    import zeroshard

    # The user's own group, not the world group: ranks {0, 1} of 4.
    group = dist.new_group([0, 1])
    if rank > 1:
        return None
    comm = zeroshard.Communicator(group)
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t)
    return (comm.world_size, t.tolist())


def test_user_process_group_is_used(runs):
    assert runs.result(4, "subgroup")[:2] == [(2, [3.0, 3.0])] * 2


def _dead_peer(rank, world_size):
    import os
    import zeroshard

    comm = zeroshard.Communicator(timeout=60)
    if rank == 1:
        os._exit(0)
    with pytest.raises(RuntimeError, match="all_reduce .* on rank 0 of 2"):
        comm.all_reduce(torch.ones(1024))
    return True


def test_dead_peer_raises_naming_the_collective():
    assert run_ranks(_dead_peer, 2, lingering_rank=1)[0] is True


def test_uninitialized_torch_distributed_is_a_clear_error():
    import zeroshard

    with pytest.raises(RuntimeError, match="init_process_group"):
        zeroshard.Communicator()
