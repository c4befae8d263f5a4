"""zeroshard: ZeRO stages 0-3 sharding for PyTorch, with a C++ core on LibTorch."""

import torch as _torch  # noqa: F401  (loads libtorch before the extension that links it)
# Note [torch._dynamo imported here]: torch.optim.Optimizer (under the engine's optimizer view)
# imports torch._dynamo on its first call, and that import keeps frame objects of its own (its
# caught import errors); a frame holds its callers, so an import first made inside
# initialize() kept initialize's frame, and the engine in its locals, alive to the end of the
# interpreter. The engine then went in the interpreter's final teardown, where a Gloo worker
# that needs the GIL while its group is destroyed aborts the process ("terminate called
# without an active exception") after a run that succeeded. Imported here, those frames hold
# only module-level ones (tests/python/test_engine_lifetime.py).
import torch._dynamo as _dynamo  # noqa: F401,E402

from zeroshard import _C
from zeroshard.comm import Communicator
from zeroshard.engine import Engine
from zeroshard.initialization import initialize
from zeroshard.launch import init_distributed
from zeroshard.pretrained import PretrainedLoad

# Config.from_file / from_dict / from_json raise ValueError naming the key path, and report
# DeepSpeed keys zeroshard does not implement through warnings.warn (docs/config.md).
Config = _C.Config
CommHandle = _C.CommHandle

__all__ = ["Config", "Communicator", "CommHandle", "Engine", "initialize", "init_distributed", "PretrainedLoad"]
__version__ = "0.1.0"
