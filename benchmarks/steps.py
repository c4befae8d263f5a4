"""One training step of each benchmarked setup, and what each should hold in model state.

Every benchmark that trains goes through make_step(name, model, recipe): zeroshard at stages
0-3 (also with ZeRO-Offload: bench_offload.py, bench_gpu.py), DDP + AdamW, DDP +
ZeroRedundancyOptimizer(AdamW), FSDP2 (fully_shard), each in fp32 (bench_stages.py) or bf16 mixed
precision (bench_bf16.py, bench_gpu.py), and the single-process recipes bench_gpu.py compares with.
A step is called with a batch of tokens and returns the loss; memory() reports the model state it
holds. state_formula(name, ...) says what that should be, in model_state.py's terms.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from gpt import next_token_loss
from state_formulas import OFFLOADS, offload_formula, state_formula, zeroshard_config  # noqa: F401 (re-exported)

FP32_CONFIGS = ("zeroshard-stage0", "zeroshard-stage1", "zeroshard-stage2", "zeroshard-stage3", "ddp",
                "ddp+zero-redundancy", "fsdp2")
BF16_CONFIGS = ("zeroshard-stage0-bf16", "zeroshard-stage1-bf16", "zeroshard-stage2-bf16",
                "zeroshard-stage3-bf16", "ddp-autocast", "fsdp2-bf16")
# One process, no wrapper: bf16 weights with an fp32 master copy (zeroshard's recipe without the
# engine), and fp32 weights under torch.autocast (the usual AMP recipe).
SINGLE_PROCESS_CONFIGS = ("plain-bf16", "plain-autocast")


@dataclass(frozen=True)
class Recipe:
    """What every setup's step is built from. The defaults are zeroshard's (DeepSpeed's) and
    torch.optim.AdamW's own; None leaves a size to each library."""

    batch: int                      # sequences per rank per step (zeroshard's micro-batch)
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    fused: bool = False             # torch.optim.AdamW(fused=True) for the torch setups
    bucket_elems: Optional[int] = None  # zeroshard reduce_bucket_size; DDP bucket_cap_mb of as many fp32 bytes
    overlap_comm: bool = True       # zeroshard's, at every stage (DDP and FSDP2 always overlap)
    persistence_threshold: int = 100_000  # zeroshard stage 3's stage3_param_persistence_threshold
    prefetch_elems: Optional[int] = None  # zeroshard stage 3's stage3_prefetch_bucket_size
    collective_timeout_seconds: Optional[float] = None
    checkpoint_keep_last: Optional[int] = None
    zeroshard_keys: Optional[dict] = None  # more keys of the zeroshard config's "zeroshard" section

    def adamw(self):
        return dict(lr=self.lr, betas=tuple(self.betas), eps=self.eps, weight_decay=self.weight_decay)


def fused_adamw_works(device="cpu"):
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def _local(t):
    # A DTensor's nbytes is the global tensor's; this rank holds only its local shard.
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).nbytes for t in tensors if t is not None)


def _optimizer_state_bytes(state):
    return sum(_local(v).nbytes for s in state.values() for v in s.values() if torch.is_tensor(v))


def _device_type(model):
    return next(model.parameters()).device.type


def _torch_adamw(params, recipe):
    kwargs = recipe.adamw()
    if recipe.fused:
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def _torch_adamw_name(recipe):
    return "torch.optim.AdamW" + ("(fused=True)" if recipe.fused else "")


class Step:
    """What a benchmark calls: step(tokens) trains one step and returns its loss; memory() is
    the model state held per rank (params, grads, optimizer, comm_buffers, total; bytes);
    forward_context() wraps an eval forward in the step's own precision; extras() adds raw
    numbers for --json; optimizer_name says what took the step."""

    optimizer_name = ""

    def forward_context(self):
        return contextlib.nullcontext()

    def extras(self):
        return {}


class EngineStep(Step):
    """A DeepSpeed-style engine's step (zeroshard's or DeepSpeed's own, deepspeed_steps.py):
    engine(x), engine.backward(loss), engine.step()."""

    def __call__(self, tokens):
        loss = next_token_loss(self.engine(tokens[:, :-1]), tokens)
        self.engine.backward(loss)
        self.engine.step()
        return loss


def _memory(params, grads, optimizer, comm_buffers=0):
    return dict(params=params, grads=grads, optimizer=optimizer, comm_buffers=comm_buffers,
                total=params + grads + optimizer + (comm_buffers or 0))


class ZeroshardStep(EngineStep):
    """offload: what ZeRO-Offload puts in host memory, of "optimizer" and "param" (OFFLOADS)."""

    def __init__(self, model, stage, recipe, bf16=False, offload=()):
        import zeroshard

        zero = {"stage": stage, "overlap_comm": recipe.overlap_comm}
        for state in offload:
            zero[f"offload_{state}"] = {"device": "cpu", "pin_memory": True}
        if recipe.bucket_elems is not None:
            zero["reduce_bucket_size"] = recipe.bucket_elems
        extras = {}
        if stage == 3:
            # Units named by class rather than found as the largest nn.ModuleList, so they are the
            # blocks fsdp2 shards whatever gpt.py's layout. Below the threshold only biases and
            # LayerNorms stay gathered.
            zero["stage3_param_persistence_threshold"] = recipe.persistence_threshold
            if recipe.prefetch_elems is not None:
                zero["stage3_prefetch_bucket_size"] = recipe.prefetch_elems
            extras["stage3_unit_classes"] = ["Block"]
        if recipe.collective_timeout_seconds is not None:
            extras["collective_timeout_seconds"] = recipe.collective_timeout_seconds
        if recipe.checkpoint_keep_last is not None:
            extras["checkpoint"] = {"keep_last": recipe.checkpoint_keep_last}
        extras.update(recipe.zeroshard_keys or {})
        adamw = recipe.adamw()
        config = {"train_micro_batch_size_per_gpu": recipe.batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {**adamw, "betas": list(adamw["betas"])}},
                  "zero_optimization": zero}
        if bf16:
            # bf16 parameters, gradients and gathers; fp32 master weights and AdamW state;
            # gradients reduced in bf16 (reduce_dtype "compute", the default).
            config["bf16"] = {"enabled": True}
        if extras:
            config["zeroshard"] = extras
        self.engine = zeroshard.initialize(model, config)
        self.model = model
        self.optimizer_name = ("zeroshard sharded AdamW (at::_fused_adamw_" + (" on the host)" if offload else ")")
                               + (", fp32 master" if bf16 else ""))

    def config_summary(self):
        """What decides this step's speed and its host synchronisations, as the engine resolved
        its config: stage, dtype, overlap_comm, nonfinite (whose "error" reads the gradient norm
        on the host at every step unless the device decides) and stage 3's gather stream (a key
        newer than some builds: None when the config has no such key)."""
        c = self.engine.config.to_dict()
        zero, extras = c.get("zero_optimization", {}), c.get("zeroshard", {})
        dtype = "bf16" if c.get("bf16", {}).get("enabled") else "fp16" if c.get("fp16", {}).get("enabled") else "fp32"
        return dict(stage=zero.get("stage"), dtype=dtype, overlap_comm=zero.get("overlap_comm"),
                    nonfinite=extras.get("nonfinite"), stage3_gather_stream=extras.get("stage3_gather_stream"))

    # forward_context: with bf16 the engine converted the model; it computes in bf16 without autocast.

    def memory(self):
        m = self.engine.memory_stats()
        # gathered_peak: the most gathered full-parameter bytes alive at once during the last
        # step (stage 3 only; below it every parameter is always whole). Not part of the total.
        # total is every place's; host and device split it (ZeRO-Offload puts states on the host).
        return dict(params=m["params"], grads=m["grads"], optimizer=m["optimizer"], comm_buffers=0,
                    total=m["total"], host=m["host_total"], device=m["device_total"],
                    gathered_peak=m["gathered_peak"] if self.engine.stage == 3 else None)

    def extras(self):
        return {"comm_stats": self.engine.comm_stats(), "memory_stats": self.engine.memory_stats()}


class TorchStep(Step):
    """zero_grad, forward and loss (under torch.autocast(bfloat16) with `autocast`: fp32
    parameters, gradients and AdamW; bf16 needs no GradScaler), loss.backward(),
    optimizer.step(): plain-autocast as it is, and the steps of DDP and FSDP2.

    Gradients are zeroed first, so the last step's are alive where memory is read; keep_grads
    zeroes them in place rather than dropping them, so that they stay allocated through the
    next forward as zeroshard's flat gradients do (bench_gpu.py's peaks)."""

    def __init__(self, model, recipe, wrapped=None, autocast=False, keep_grads=False, optimizer=None,
                 optimizer_name=None, local_state=None):
        self.model, self.wrapped = model, wrapped or model
        self.autocast, self.keep_grads = autocast, keep_grads
        self.optimizer = optimizer or _torch_adamw(model.parameters(), recipe)
        self.optimizer_name = optimizer_name or _torch_adamw_name(recipe)
        self.local_state = self.optimizer.state if local_state is None else local_state

    def __call__(self, tokens):
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        with self.forward_context():
            loss = next_token_loss(self.wrapped(tokens[:, :-1]), tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def forward_context(self):
        if self.autocast:
            return torch.autocast(_device_type(self.model), dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def comm_buffers(self):
        return 0

    def memory(self):
        params = list(self.model.parameters())
        return _memory(_nbytes(params), _nbytes(p.grad for p in params), _optimizer_state_bytes(self.local_state),
                       self.comm_buffers())


class DDPStep(TorchStep):
    """DDP + torch.optim.AdamW, or DDP + ZeroRedundancyOptimizer(AdamW) (its documented use);
    autocast: the AMP recipe (TorchStep)."""

    def __init__(self, model, zero, recipe, autocast=False):
        from torch.nn.parallel import DistributedDataParallel

        # Bucket capacity as close as DDP allows to zeroshard's reduce_bucket_size (in fp32
        # elements: DDP's gradients stay fp32 under autocast).
        kwargs = {} if recipe.bucket_elems is None else {"bucket_cap_mb": recipe.bucket_elems * 4 / 2**20}
        self.ddp = DistributedDataParallel(model, **kwargs)
        optimizer = name = local_state = None
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            kwargs = recipe.adamw()
            if recipe.fused:
                kwargs["fused"] = True
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
            name = f"ZeroRedundancyOptimizer({_torch_adamw_name(recipe)})"
            local_state = optimizer.optim.state
        super().__init__(model, recipe, wrapped=self.ddp, autocast=autocast, optimizer=optimizer,
                         optimizer_name=name, local_state=local_state)

    def comm_buffers(self):
        """Bytes of DDP's gradient buckets: separate from .grad unless gradient_as_bucket_view."""
        data = self.ddp._get_ddp_logging_data()  # private, but the only place DDP reports its buckets
        sizes = data.get("bucket_sizes")
        if not sizes or data.get("gradient_as_bucket_view"):
            return 0 if sizes else None
        return sum(int(s) for s in str(sizes).split(",") if s.strip())

    def extras(self):
        # Logging data keeps the construction-time buckets (one, until the first backward
        # rebuilds them); the reducer's own copies show the buckets actually in use.
        current = [b.buffer().nbytes for b in self.ddp.reducer._get_zeros_like_grad_buckets()]
        return {"ddp_bucket_bytes_at_construction": str(self.ddp._get_ddp_logging_data().get("bucket_sizes")),
                "ddp_bucket_bytes": current}


class FSDP2Step(TorchStep):
    """FSDP2's standard recipe: fully_shard on every block, then on the root (which takes the
    embeddings, final norm and head), reshard_after_forward=True; AdamW on the DTensor shards,
    whose local shards memory() counts: after backward every unit is resharded, and .grad is the
    reduce-scattered shard (the all-gather and reduce-scatter buffers are transient).
    bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) on every fully_shard call:
    fp32 sharded parameters, gradients and AdamW; bf16 gathers, compute and reduce-scatters (the
    policy casts inside fully_shard's hooks: no autocast)."""

    def __init__(self, model, recipe, bf16=False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(_device_type(model), (dist.get_world_size(),))
        kwargs = {"mesh": mesh}
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        # fused=True runs on CPU DTensor parameters (checked with torch 2.13: same losses as
        # foreach and the default), so fsdp2 uses whatever the DDP rows use.
        super().__init__(model, recipe)
        self.optimizer_name += " on DTensor shards"


class MasterWeightsStep(Step):
    """bf16 model, fp32 master weights, torch.optim.AdamW on the master: zeroshard's recipe in
    one process without the engine (bench_gpu.py's fair peer)."""

    def __init__(self, model, recipe):
        self.model, self.params = model, list(model.parameters())
        self.master = [p.detach().clone() for p in self.params]
        model.to(torch.bfloat16)
        self.optimizer = _torch_adamw(self.master, recipe)
        self.optimizer_name = _torch_adamw_name(recipe) + " on an fp32 master"

    def __call__(self, tokens):
        loss = next_token_loss(self.model(tokens[:, :-1]), tokens)
        loss.backward()
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float()  # transient fp32 gradient, as zeroshard's step makes it
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
            for m, p in zip(self.master, self.params):
                m.grad = None
                p.grad.zero_()  # kept allocated, like zeroshard's flat gradients
        return loss

    def memory(self):
        # The fp32 master counts with the optimizer state, as in zeroshard's memory_stats().
        return _memory(_nbytes(self.params), _nbytes(p.grad for p in self.params),
                       _nbytes(self.master) + _optimizer_state_bytes(self.optimizer.state))


def make_step(name, model, recipe):
    """The step of config `name` (FP32_CONFIGS, BF16_CONFIGS or SINGLE_PROCESS_CONFIGS, or a
    zeroshard one with an OFFLOADS suffix) around `model`; "deepspeed-stage<k>": DeepSpeed itself
    (deepspeed_steps.py); any of them + "-compiled": its blocks compiled (compiled_steps.py)."""
    if name.endswith("-compiled"):
        from compiled_steps import compiled_step

        return compiled_step(name[:-len("-compiled")], model, recipe)
    if name.startswith("deepspeed-"):
        from deepspeed_steps import DeepSpeedStep, stage_of

        return DeepSpeedStep(model, stage_of(name), recipe)
    bf16 = name.endswith("-bf16")
    base = name[:-len("-bf16")] if bf16 else name
    if base.startswith("zeroshard-stage"):
        stage, _precision, offload = zeroshard_config(name)
        return ZeroshardStep(model, stage, recipe, bf16=bf16, offload=offload)
    if base == "fsdp2":
        return FSDP2Step(model, recipe, bf16=bf16)
    if base in ("ddp", "ddp+zero-redundancy", "ddp-autocast"):
        return DDPStep(model, zero=(base == "ddp+zero-redundancy"), recipe=recipe, autocast=(base == "ddp-autocast"))
    if name == "plain-bf16":
        return MasterWeightsStep(model, recipe)
    if name == "plain-autocast":
        # Zeroed in place: allocated through the forward, as zeroshard's flat gradients are.
        return TorchStep(model, recipe, autocast=True, keep_grads=True)
    raise ValueError(f"unknown config {name}")
