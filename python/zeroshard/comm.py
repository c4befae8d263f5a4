"""The communicator over a torch.distributed process group.

The collectives run in C++ on the very c10d ProcessGroup the user created; the group is
handed over by its registered name, which c10d resolves on the C++ side.
"""

from datetime import timedelta

import torch.distributed as dist

from zeroshard import _C


def _group_or_default(process_group):
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "zeroshard: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (torchrun sets the variables), "
            "or pass process_group="
        )
    return dist.group.WORLD


class Communicator(_C.Communicator):
    """All-gather, reduce-scatter, all-reduce and broadcast into flat buffers, counting bytes.

    Each collective blocks unless ``async_op=True``, which returns a handle to ``wait()`` on.
    ``timeout`` bounds every collective: a dead or stalled peer raises ``RuntimeError``
    naming the collective instead of hanging.
    """

    def __init__(self, process_group=None, timeout=timedelta(minutes=10)):
        group = _group_or_default(process_group)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        super().__init__(group.group_name, seconds)
