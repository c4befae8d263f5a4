"""One training step per benchmarked setup (zeroshard, DDP, DDP + ZeroRedundancyOptimizer,
FSDP2), in fp32 (bench_stages.py) or bf16 mixed precision (bench_bf16.py), and what each holds
in model state. make_step() turns a config name into its step."""

import contextlib

import torch
import torch.distributed as dist

from gpt import next_token_loss

FP32_CONFIGS = ("zeroshard-stage0", "zeroshard-stage1", "zeroshard-stage2", "zeroshard-stage3", "ddp",
                "ddp+zero-redundancy", "fsdp2")
BF16_CONFIGS = ("zeroshard-stage0-bf16", "zeroshard-stage1-bf16", "zeroshard-stage2-bf16",
                "zeroshard-stage3-bf16", "ddp-autocast", "fsdp2-bf16")


def _local(t):
    # A DTensor's nbytes is the global tensor's; this rank holds only its local shard.
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).nbytes for t in tensors if t is not None)


def _optimizer_state_bytes(state):
    return sum(_local(v).nbytes for s in state.values() for v in s.values() if torch.is_tensor(v))


def _adamw_kwargs(s):
    return dict(lr=s["lr"], weight_decay=s["weight_decay"], betas=(0.9, 0.999), eps=1e-8)


def _torch_adamw(params, s):
    kwargs = _adamw_kwargs(s)
    if s["fused"]:
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def _torch_adamw_name(s):
    return "torch.optim.AdamW" + ("(fused=True)" if s["fused"] else "")


def fused_adamw_works():
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def _ddp_bucket_bytes(ddp):
    """Bytes of DDP's gradient buckets: separate from .grad unless gradient_as_bucket_view."""
    data = ddp._get_ddp_logging_data()  # private, but the only place DDP reports its buckets
    sizes = data.get("bucket_sizes")
    if not sizes or data.get("gradient_as_bucket_view"):
        return 0 if sizes else None
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


def _autocast(enabled):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


class ZeroshardStep:
    def __init__(self, model, stage, s, bf16=False):
        import zeroshard

        config = {
            "train_micro_batch_size_per_gpu": s["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {**_adamw_kwargs(s), "betas": [0.9, 0.999]}},
            # overlap_comm on at every stage unless --overlap-comm off (DeepSpeed's default is off
            # below stage 3): DDP and FSDP2 overlap their reductions with backward too.
            "zero_optimization": {"stage": stage, "reduce_bucket_size": s["bucket_elems"],
                                  "overlap_comm": s.get("overlap_comm", True)},
        }
        if bf16:
            # bf16 parameters, gradients and gathers; fp32 master weights and AdamW state;
            # gradients reduced in bf16 (reduce_dtype "compute", the default).
            config["bf16"] = {"enabled": True}
        if stage == 3:
            # Default prefetch and reshard_after_forward; units named by class rather than found
            # as the largest nn.ModuleList, so they are the blocks fsdp2 shards whatever gpt.py's
            # layout. Below the threshold only biases and LayerNorms stay gathered.
            config["zero_optimization"]["stage3_param_persistence_threshold"] = s["persistence_threshold"]
            config["zeroshard"] = {"stage3_unit_classes": ["Block"]}
        self.engine = zeroshard.initialize(model, config)
        self.optimizer_name = "zeroshard sharded AdamW (at::_fused_adamw_)" + (", fp32 master" if bf16 else "")

    def __call__(self, tokens):
        loss = next_token_loss(self.engine(tokens[:, :-1]), tokens)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def forward_context(self):
        # With bf16 the engine converted the model: it computes in bf16 without autocast.
        return contextlib.nullcontext()

    def memory(self):
        m = self.engine.memory_stats()
        # gathered_peak: the most gathered full-parameter bytes alive at once during the last
        # step (stage 3 only; below it every parameter is always whole). Not part of the total.
        return dict(params=m["params"], grads=m["grads"], optimizer=m["optimizer"], comm_buffers=0,
                    total=m["total"], gathered_peak=m["gathered_peak"] if self.engine.stage == 3 else None)

    def extras(self):
        return {"comm_stats": self.engine.comm_stats(), "memory_stats": self.engine.memory_stats()}


class DDPStep:
    """DDP + torch.optim.AdamW, or DDP + ZeroRedundancyOptimizer(AdamW) (its documented use).
    autocast: forward and loss under torch.autocast("cpu", bfloat16) with fp32 parameters,
    gradients and AdamW (the usual AMP recipe; bf16 needs no GradScaler)."""

    def __init__(self, model, zero, s, autocast=False):
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        self.autocast = autocast
        # Bucket capacity as close as DDP allows to zeroshard's reduce_bucket_size (in fp32
        # elements: DDP's gradients stay fp32 under autocast).
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=s["bucket_elems"] * 4 / 2**20)
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            kwargs = _adamw_kwargs(s)
            if s["fused"]:
                kwargs["fused"] = True
            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
            self.local_state = self.optimizer.optim.state
            self.optimizer_name = f"ZeroRedundancyOptimizer({_torch_adamw_name(s)})"
        else:
            self.optimizer = _torch_adamw(model.parameters(), s)
            self.local_state = self.optimizer.state
            self.optimizer_name = _torch_adamw_name(s)

    def __call__(self, tokens):
        # Zeroing first leaves the last step's gradients alive at the end, where memory is read.
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(self.autocast):
            loss = next_token_loss(self.ddp(tokens[:, :-1]), tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def forward_context(self):
        return _autocast(self.autocast)

    def memory(self):
        params = list(self.model.parameters())
        buckets = _ddp_bucket_bytes(self.ddp)
        m = dict(params=_nbytes(params), grads=_nbytes(p.grad for p in params),
                 optimizer=_optimizer_state_bytes(self.local_state), comm_buffers=buckets)
        m["total"] = m["params"] + m["grads"] + m["optimizer"] + (buckets or 0)
        return m

    def extras(self):
        # Logging data keeps the construction-time buckets (one, until the first backward
        # rebuilds them); the reducer's own copies show the buckets actually in use.
        current = [b.buffer().nbytes for b in self.ddp.reducer._get_zeros_like_grad_buckets()]
        return {"ddp_bucket_bytes_at_construction": str(self.ddp._get_ddp_logging_data().get("bucket_sizes")),
                "ddp_bucket_bytes": current}


class FSDP2Step:
    """FSDP2's standard recipe: fully_shard on every block, then on the root (which takes the
    embeddings, final norm and head), reshard_after_forward=True; AdamW on the DTensor shards.
    bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) on every fully_shard call:
    fp32 sharded parameters, gradients and AdamW; bf16 gathers, compute and reduce-scatters."""

    def __init__(self, model, s, bf16=False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        kwargs = {"mesh": mesh}
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        # fused=True runs on CPU DTensor parameters (checked with torch 2.13: same losses as
        # foreach and the default), so fsdp2 uses whatever the DDP rows use.
        self.optimizer = _torch_adamw(model.parameters(), s)
        self.optimizer_name = _torch_adamw_name(s) + " on DTensor shards"

    def __call__(self, tokens):
        self.optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(self.model(tokens[:, :-1]), tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def forward_context(self):
        # The mixed-precision policy casts inside fully_shard's hooks.
        return contextlib.nullcontext()

    def memory(self):
        # Local shards only: after backward every unit is resharded, and .grad is the
        # reduce-scattered shard. FSDP2's all-gather and reduce-scatter buffers are transient.
        params = list(self.model.parameters())
        m = dict(params=_nbytes(params), grads=_nbytes(p.grad for p in params),
                 optimizer=_optimizer_state_bytes(self.optimizer.state), comm_buffers=0)
        m["total"] = m["params"] + m["grads"] + m["optimizer"]
        return m

    def extras(self):
        return {}


def make_step(name, model, s):
    """The step of config `name` (one of FP32_CONFIGS or BF16_CONFIGS), wrapping `model`."""
    bf16 = name.endswith("-bf16")
    base = name[:-len("-bf16")] if bf16 else name
    if base.startswith("zeroshard-stage"):
        return ZeroshardStep(model, int(base[-1]), s, bf16=bf16)
    if base == "fsdp2":
        return FSDP2Step(model, s, bf16=bf16)
    if base in ("ddp", "ddp+zero-redundancy", "ddp-autocast"):
        return DDPStep(model, zero=(base == "ddp+zero-redundancy"), s=s, autocast=(base == "ddp-autocast"))
    raise ValueError(f"unknown config {name}")
