"""DeepSpeed's ZeRO stages 0-3 as a benchmark step, through the real `deepspeed` package on CPU.

`deepspeed-stage<k>` trains with deepspeed.initialize over the Gloo group the ranks already
share (DS_ACCELERATOR=cpu, set in the rank before the first import), from the same steps.Recipe
as the zeroshard rows: fp32, the same micro-batch, no clipping, reduce_bucket_size (and
allgather_bucket_size, as DeepSpeed's ZeRO-2 example pairs them) of recipe.bucket_elems elements,
overlap_comm as zeroshard's, stage 3's persistence threshold and prefetch size. The optimizer is
DeepSpeed's own "AdamW" with "torch_adam": true, i.e. torch.optim.AdamW built by DeepSpeed
on its flat fp32 partitions, with fused=True where the torch rows use it (DeepSpeed passes the
extra key through to torch).

Model state is not measured for these rows: DeepSpeed keeps it in private buffers (a flat
parameter buffer, an fp32 copy of the partition even in fp32 training, gradient partitions and
bucket buffers) whose names change between versions; memory() says None, and peak RSS is the
memory comparison with them.
"""

import importlib.util
import os
import subprocess
import sys
import warnings

from steps import EngineStep

DEEPSPEED_CONFIGS = ("deepspeed-stage0", "deepspeed-stage1", "deepspeed-stage2", "deepspeed-stage3")
PREFIX = "deepspeed-stage"


# Note [DeepSpeed's shm op]: DeepSpeed's CPU communication backend JIT-builds a shared-memory
# op (ShareMemCommBuilder, with ninja, into ~/.cache/torch_extensions) whenever it wraps a
# process group. Two ranks building it at once the first time on a machine were seen to abort
# one of them (SIGABRT), so the check below builds it once, alone, before any rank starts
# (about a minute on 2 cores the first time, a second later on).
_CHECK = """
import deepspeed
try:
    from deepspeed.comm.torch import build_shm_op
except ImportError:  # a version without it builds nothing there either
    build_shm_op = None
if build_shm_op is not None:
    build_shm_op()
print(deepspeed.__version__)
"""


def deepspeed_unavailable(timeout=300.0):
    """(version, None) when `import deepspeed` works on CPU in a fresh interpreter, else (None,
    why not). A fresh interpreter: a failed or slow import must not leave half of DeepSpeed
    (which patches torch on import) in the benchmark's parent process. Builds DeepSpeed's CPU
    communication op on the way (Note [DeepSpeed's shm op])."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "deepspeed is not installed (pip install deepspeed; it runs on CPU with DS_ACCELERATOR=cpu)"
    code = _CHECK
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"import deepspeed (and its CPU communication op's build) took more than {timeout:.0f} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, f"import deepspeed on CPU failed: {lines[-1] if lines else f'exit {done.returncode}'}"
    return done.stdout.strip().splitlines()[-1], None


def deepspeed_config(stage, recipe, world_size):
    """DeepSpeed's config for `recipe` at ZeRO `stage`: the keys the zeroshard rows set, by
    DeepSpeed's names."""
    adamw = recipe.adamw()
    params = {**adamw, "betas": list(adamw["betas"]), "torch_adam": True}
    if recipe.fused:
        params["fused"] = True  # passed through to torch.optim.AdamW (deepspeed/runtime/engine.py)
    zero = {"stage": stage, "overlap_comm": recipe.overlap_comm}
    if recipe.bucket_elems is not None:
        zero["reduce_bucket_size"] = recipe.bucket_elems
        zero["allgather_bucket_size"] = recipe.bucket_elems
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = recipe.persistence_threshold
        if recipe.prefetch_elems is not None:
            zero["stage3_prefetch_bucket_size"] = recipe.prefetch_elems
    return {"train_micro_batch_size_per_gpu": recipe.batch, "gradient_accumulation_steps": 1,
            "train_batch_size": recipe.batch * world_size, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def stage_of(name):
    if not name.startswith(PREFIX) or name[len(PREFIX):] not in ("0", "1", "2", "3"):
        raise ValueError(f"unknown DeepSpeed config {name!r}: expected one of {', '.join(DEEPSPEED_CONFIGS)}")
    return int(name[len(PREFIX):])


class DeepSpeedStep(EngineStep):
    """engine(x), engine.backward(loss), engine.step(): a DeepSpeed script's step, on ZeRO
    stage `stage` in fp32."""

    def __init__(self, model, stage, recipe):
        import logging

        import torch.distributed as dist

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed asserts a launcher's LOCAL_RANK; ranks.py's processes all run on this machine,
        # so a rank's local rank is its rank (torchrun sets it already).
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        import deepspeed

        # Its INFO lines (the config, each ZeRO phase) and torch's deprecation warning at each of
        # its all-gathers and reduce-scatters would bury the benchmark's progress.
        deepspeed.utils.logger.setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        self.config = deepspeed_config(stage, recipe, dist.get_world_size())
        # The ranks joined their group already: DeepSpeed wraps it (deepspeed.comm: "the user
        # initialized torch.dist themselves").
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=self.config, dist_init_required=False)
        self.model, self.stage, self.version = model, stage, deepspeed.__version__
        fused = "(fused=True)" if recipe.fused else ""
        self.optimizer_name = f"DeepSpeed {self.version} ZeRO-{stage}, torch.optim.AdamW{fused} (torch_adam)"

    def memory(self):
        # Not measured (module docstring): None everywhere, so no table divides by it.
        return dict(params=None, grads=None, optimizer=None, comm_buffers=None, total=None)

    def extras(self):
        # The torch optimizer DeepSpeed built on its partitions ("torch_adam"), under its wrapper.
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        return {"deepspeed_version": self.version, "deepspeed_config": self.config,
                "deepspeed_optimizer": type(self.engine.optimizer).__name__,
                "torch_optimizer": type(inner).__name__, "torch_fused": inner.defaults.get("fused")}
