"""deepspeed.init_distributed() and deepspeed.add_config_arguments() over zeroshard's own setup."""

from datetime import timedelta

import torch.distributed as dist

import zeroshard
from zeroshard._warnings import warn_at_caller

_BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=timedelta(minutes=30), init_method=None, dist_init_required=None, config=None,
                     rank=-1, world_size=-1):
    """Joins torch.distributed from the torchrun variables (zeroshard.init_distributed) unless it
    is initialized already: Gloo for CPU tensors, NCCL for CUDA ones on device LOCAL_RANK. Run
    without torchrun, a group of one process. DeepSpeed's signature; the MPI discovery,
    distributed_port and config arguments have nothing to do here and are accepted as such."""
    if dist.is_available() and dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("zeroshard.deepspeed.init_distributed: dist_init_required=False but torch.distributed "
                           "is not initialized; initialize it first or leave dist_init_required unset")
    if init_method not in (None, "env://") or rank != -1 or world_size != -1:
        raise ValueError("zeroshard.deepspeed.init_distributed: init_method, rank and world_size are not supported; "
                         "launch with torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or call "
                         "torch.distributed.init_process_group yourself before initialize()")
    if dist_backend is not None and dist_backend not in _BACKENDS:
        warn_at_caller(f"zeroshard.deepspeed.init_distributed: dist_backend={dist_backend!r} is not used: zeroshard "
                       "takes Gloo for CPU tensors and NCCL for CUDA tensors")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    zeroshard.init_distributed(timeout_seconds=seconds)


def add_config_arguments(parser):
    """Adds DeepSpeed's arguments to an argparse parser, as DeepSpeed does: --deepspeed (a flag for
    the script's own use), --deepspeed_config <file>, and the deprecated --deepscale and
    --deepscale_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
