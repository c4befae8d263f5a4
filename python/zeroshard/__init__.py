"""zeroshard: ZeRO stages 0-3 sharding for PyTorch, with a C++ core on LibTorch."""

import torch as _torch  # noqa: F401  (loads libtorch before the extension that links it)

from zeroshard import _C
from zeroshard.comm import Communicator
from zeroshard.engine import Engine, initialize
from zeroshard.launch import init_distributed
from zeroshard.pretrained import PretrainedLoad

# Config.from_file / from_dict / from_json raise ValueError naming the key path, and report
# DeepSpeed keys zeroshard does not implement through warnings.warn (docs/config.md).
Config = _C.Config
CommHandle = _C.CommHandle

__all__ = ["Config", "Communicator", "CommHandle", "Engine", "initialize", "init_distributed", "PretrainedLoad"]
__version__ = "0.1.0"
