"""zeroshard.init_distributed(): the process group a training script runs in, from torchrun's
variables (or a single rank without them), with the device rule zeroshard uses everywhere."""

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard._warnings import warn_at_caller


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_seconds=600.0):
    """Initializes torch.distributed from the torchrun variables unless it already is.

    Gloo for CPU tensors, NCCL for CUDA tensors on device LOCAL_RANK. Run without torchrun
    (no RANK/WORLD_SIZE), it makes a group of one process, as DeepSpeed does.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        print("zeroshard: no torchrun variables (RANK, WORLD_SIZE): running as a single rank, so nothing "
              "is sharded; launch with `torchrun --nproc-per-node N` to shard over N ranks",
              file=sys.stderr, flush=True)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    backend = "gloo"
    # Without torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE: one machine (as initProcessGroupFromEnv).
    # (A RANK or WORLD_SIZE missing is init_process_group's error to report.)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    # A GPU for every rank on this machine, or none used (the rule is the C++ launcher's too).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_gpu, gpu, warning = _C._choose_device(local_rank, local_world, gpus)
    if use_gpu:
        torch.cuda.set_device(gpu)
        backend = "cpu:gloo,cuda:nccl"
    elif warning:
        warn_at_caller(warning)
    timeout = timedelta(seconds=timeout_seconds)
    store = _restarted_job_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.group.WORLD


def _restarted_job_store(timeout):
    """Note [a restarted job's store]: torchrun's agent hosts the store its workers meet in
    (TORCHELASTIC_USE_AGENT_STORE) and, in torch 2.13, keeps the same one when it restarts them
    (--max-restarts): the new workers' init_process_group would read the addresses the dead
    ones left there and fail to connect (pytorch/pytorch#135712). A restarted worker meets in a
    part of that store of its attempt's own, as torch's own env:// once did. The attempt count is
    each agent's: on one node it is every worker's; on several, an agent that restarts for
    another node's failure may count differently (the torch issue), and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun gives each attempt a store of its own.
    None when there is nothing to work around (the first attempt, or a store of the job's own)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == 0:
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"zeroshard/attempt_{attempt}", agent)
