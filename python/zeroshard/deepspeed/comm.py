"""deepspeed.comm as training scripts use it: the rank queries and a few collectives, all of
them torch.distributed's own (zeroshard's engine uses the same default group)."""

import os

import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401  (deepspeed.comm.ReduceOp)

from zeroshard.deepspeed.distributed import init_distributed  # noqa: F401


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None):
    return dist.get_rank(group)


def get_world_size(group=None):
    return dist.get_world_size(group)


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None):
    return dist.barrier(group)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
