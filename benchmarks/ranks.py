"""Fresh processes for a benchmark's ranks, joined in one torch.distributed group.

Each call starts world_size new processes (so each peak RSS belongs to that call alone), puts
one torch thread on each, and returns what fn returned on every rank. A rank that raises stops
the others, and its traceback is raised here; a call past its deadline is stopped the same way.
"""

import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank, world_size, port, timeout, backend="gloo"):
    """Joins this process to the group at 127.0.0.1:port; timeout in seconds bounds every
    collective. backend "cpu:gloo,cuda:nccl" is zeroshard.init_distributed's for CUDA tensors."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))


def _rank_entry(rank, fn, world_size, port, timeout, results, args):
    torch.set_num_threads(1)
    init_group(rank, world_size, port, timeout)
    try:
        value = fn(rank, world_size, *args)
        # Through a file: a pickled value is copied, where a queue would share tensors with
        # file descriptors that close with this process.
        Path(results, f"rank{rank}.pkl").write_bytes(pickle.dumps(value))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size, *args, timeout=300.0):
    """fn(rank, world_size, *args) on world_size fresh Gloo ranks; their results by rank. fn
    must be a module-level function (it is pickled); timeout: seconds for the whole call."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-bench-ranks-") as results:
        context = mp.start_processes(_rank_entry, args=(fn, world_size, free_port(), timeout, results, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish within {timeout:.0f} s")
        return [pickle.loads(Path(results, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]

