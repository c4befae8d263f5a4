"""This process's rank, for output every rank would otherwise repeat: rank 0 says it once.

torch.distributed's rank once it is initialized, else the launcher's RANK (torchrun sets it
before any zeroshard code runs: a Config read before init_process_group knows its rank too),
else 0: a lone process is rank 0.
"""

import os
import sys


def this_rank():
    dist = sys.modules.get("torch.distributed")  # never the reason torch gets imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
