"""zeroshard.initialize() and the Engine a training script talks to.

The work happens in C++ (zeroshard._C.Engine); this layer only collects the model's
parameters by name, finds the process group, and forwards calls.
"""

import contextlib
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard import _C, auto as _auto, meta as _meta, stage3
from zeroshard import peft_adapter as _peft_adapter, quantized as _quantized
from zeroshard._warnings import warn_at_caller
from zeroshard.logs import wire_logging
from zeroshard.lr_schedule import ConfigSchedule
from zeroshard.optimizer_view import EngineOptimizer
from zeroshard import pretrained as _pretrained
from zeroshard.pretrained import PretrainedLoad
from zeroshard.launch import init_distributed
from zeroshard.peers import names_missing_ranks

def _load_config(config):
    if isinstance(config, _C.Config):
        return config
    if isinstance(config, dict):
        return _C.Config.from_dict(config)
    if isinstance(config, (str, Path)):
        return _C.Config.from_file(str(config))
    raise TypeError(f"zeroshard.initialize: config must be a path, a dict or a zeroshard.Config, "
                    f"not {type(config).__name__}")


def _param_groups(model, param_groups):
    """[{"names", "params", and the group's lr, weight_decay, betas, eps}], named and checked in
    C++ (a tensor that is not the model's, a trainable parameter in no group, an unknown key)."""
    groups = None
    if param_groups is not None:
        groups = [g if isinstance(g, dict) else {"params": g} for g in param_groups]
        groups = [{**g, "params": list(g["params"])} if "params" in g else g for g in groups]
    return _C._param_groups(groups, list(model.named_parameters()))


class Engine:
    """Runs the model and its ZeRO-sharded training step (see zeroshard.initialize)."""

    def __init__(self, module, core, config, hooks=(), trained=None, optimizer=None, lr_scheduler=None):
        self.module = module
        self.config = config
        self._core = core
        self._hooks = list(hooks)
        self._trained = trained or {}  # id(parameter) -> its name, for the trained parameters
        self.optimizer = optimizer
        # A client scheduler (stepped here after each optimizer step taken), else the config's
        # (stepped in C++), else None.
        self.lr_scheduler = lr_scheduler
        self._client_scheduler = lr_scheduler is not None
        self._last_load_stats = None
        # zeroshard.checkpoint.every_minutes: saved here, after the scheduler's step, through
        # save_checkpoint (client scheduler state included), not inside the C++ step.
        core.set_clock_saves(False)
        # A callable returning the client_state of the checkpoints saved on the clock (None: none).
        self.clock_client_state = None

    @names_missing_ranks
    def __call__(self, *args, **kwargs):
        self._core.begin_forward()  # wall_clock_breakdown's forward time
        try:
            return self.module(*args, **kwargs)
        finally:
            self._core.end_forward()

    forward = __call__

    @names_missing_ranks
    def backward(self, loss):
        """Backpropagates loss / gradient_accumulation_steps and reduces the gradients."""
        self._core.backward(loss)

    @names_missing_ranks
    def step(self):
        """Call after every backward; steps the optimizer at the accumulation boundary.

        Returns True when the optimizer stepped. A scheduler passed to initialize steps right
        after, unless fp16 skipped the step for an overflow (as DeepSpeed does). With the
        deferred nonfinite check (zeroshard.nonfinite_check) a step returns True and is found
        skipped on the device later: at the next step, log line or save, or check_last_step(). With
        zeroshard.checkpoint.every_minutes, the first boundary that many minutes after the last
        save (rank 0's clock decides for every rank) then saves into zeroshard.checkpoint.dir,
        with clock_client_state() as its client_state when that is set."""
        boundary = self._core.is_gradient_accumulation_boundary
        if boundary and self.optimizer is not None:
            self.optimizer.push()
        # Read only with a client scheduler, whose engine checks immediately (initialize): reading
        # skipped_steps settles the deferred check, a wait on the device.
        skipped = self._core.skipped_steps if self._client_scheduler else 0
        stepped = self._core.step()
        if stepped and self.optimizer is not None:
            self.optimizer.pull()  # what the step used, and a config schedule's next lr
            self.optimizer._stepped()
            if self._client_scheduler and self._core.skipped_steps == skipped:
                self.lr_scheduler.step()
                self.optimizer.push()
        if boundary and self._core.checkpoint_due():
            client_state = self.clock_client_state() if self.clock_client_state is not None else None
            self.save_checkpoint(self.config.zeroshard.checkpoint_dir, client_state=client_state)
        return stepped

    @names_missing_ranks
    def check_last_step(self):
        """With the deferred nonfinite check (zeroshard.nonfinite_check; on a GPU by default), reads
        whether the last optimizer step was skipped on the device for an inf or NaN gradient:
        zeroshard.nonfinite "error" raises, naming the step, "skip" counts it in skipped_steps.
        step(), the log line, save_checkpoint, global_steps and skipped_steps do this
        themselves; call it after the last step of a run that ends without any of them. Every
        rank calls it; it waits for the last step on the device."""
        self._core.check_last_step()

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter is whole (stage 3 gathers them; a no-op below stage 3).
        Read them; changes made inside are not kept at stage 3."""
        self._core.gather_parameters()
        try:
            yield
        finally:
            self._core.reshard_parameters()

    def full_state_dict(self, rank0_only=False, dtype=None):
        """The model's state dict with full tensors and the original names, on CPU.

        Every rank takes part; with rank0_only=True the other ranks get an empty dict.
        dtype=None: the trained parameters as the model holds them (16-bit with bf16/fp16).
        dtype=torch.float32: the fp32 master weights the optimizer keeps, gathered, not the
        16-bit copy; another dtype: those cast to it. Buffers and frozen parameters keep theirs."""
        if dtype is None:
            with self.gathered_parameters():
                if rank0_only and self._core.rank != 0:
                    return {}
                return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        master = dict(self._core.master_weights())
        out = {}
        with self.gathered_parameters():  # stage 3's frozen parameters are sharded too
            if rank0_only and self._core.rank != 0:
                return {}
            for key, value in self.module.state_dict(keep_vars=True).items():
                name = self._trained.get(id(value))
                out[key] = master[name].to(dtype) if name is not None else value.detach().to("cpu", copy=True)
        return out

    def stage3_units(self):
        """The units stage 3 built (empty below stage 3), in order, the root unit last: each a
        dict with its name, numel (elements gathered and released with it), params, and
        persistent: its parameters of at most stage3_param_persistence_threshold elements, which
        stay gathered for the whole run (a full copy on every rank plus their optimizer shard),
        with persistent_numel their elements."""
        return self._core.stage3_units()

    def plan(self):
        """The sharding plan, one line per state (parameters, gradients, optimizer state): sharded
        or replicated, over which ranks, and where it lives."""
        return self._core.plan()

    def memory_stats(self):
        """Bytes of parameters, gradients, optimizer state and frozen parameters this rank holds
        between steps (params, grads, optimizer, frozen, total), and peaks of the last step that are not in the
        total: gathered_peak (stage 3's whole unit parameters), secondary_peak (hpZ's secondary
        shards), staging_peak (gradient staging buffers) and fp32_grads_peak (fp32 copies of
        16-bit gradient shards in the step). With offload, host_* and device_* split each state
        by place."""
        return self._core.memory_stats()

    def comm_stats(self):
        """Bytes and calls per collective kind in the last optimizer step. With hybrid sharding
        (zeroshard.shard_group_size) also "intra" and "inter": the same inside the shard group
        and across the groups, which add up to the whole; with hpZ
        (zero_optimization.zero_hpz_partition_size) "intra" is the secondary groups' backward
        gathers and "inter" the collectives over the world."""
        return self._core.comm_stats()

    @names_missing_ranks
    def save_checkpoint(self, save_dir, tag=None, client_state=None, exclude_frozen_parameters=False):
        """Saves a sharded checkpoint to save_dir/tag (default tag: "global_step<N>").

        exclude_frozen_parameters (DeepSpeed's): the frozen parameters (a LoRA base) are left
        out; loading the checkpoint keeps the ones the model has (docs/checkpoints.md).

        Every rank calls it between optimizer steps; each writes its own shards in parallel.
        The checkpoint becomes visible (and `latest` points at it) only once complete, and
        zeroshard.checkpoint.keep_last older ones are kept. client_state (numbers, strings,
        containers and tensors: what torch.load(weights_only=True) reads) is saved from rank 0.
        Returns the checkpoint's path. On any rank's error it fails on every rank. A scheduler
        passed to initialize is saved with it (its state_dict)."""
        blob, error = b"", ""
        if self._client_scheduler:
            client_state = {_CLIENT_STATE: client_state, _CLIENT_SCHEDULER: self.lr_scheduler.state_dict()}
        if client_state is not None and self._core.rank == 0:
            try:
                blob = _client_state_bytes(client_state)
            except Exception as e:  # reported on every rank by the collective save
                error = f"client_state cannot be saved: {type(e).__name__}: {e}"
        self._refresh_module_state()
        return self._core.save_checkpoint(os.fspath(save_dir), tag or "", blob, error,
                                          exclude_frozen_parameters=bool(exclude_frozen_parameters))

    @names_missing_ranks
    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
        """Loads load_dir/tag (default: the one `latest` names) at any world size and stage.

        Every rank calls it between optimizer steps; each reads only its own slices. Returns
        (path, client_state), as DeepSpeed does; on any error nothing changes on any rank.
        load_optimizer_states=False takes only the weights (and buffers): AdamW state, step
        count, lr and loss scale stay this engine's, e.g. to fine-tune from a checkpoint.
        load_lr_scheduler_states=False keeps this engine's scheduler as it is."""
        client_state = {}
        scheduler_state = None

        def unpickle(blob):
            # Called by the load once it has read the client state, before it changes anything:
            # an unreadable one fails the load on every rank.
            nonlocal client_state, scheduler_state
            try:
                client_state = torch.load(io.BytesIO(blob), weights_only=True) if blob else {}
            except Exception as e:
                return f"client_state cannot be read: {type(e).__name__}: {e}"
            if isinstance(client_state, dict) and _CLIENT_SCHEDULER in client_state:
                scheduler_state = client_state[_CLIENT_SCHEDULER]
                client_state = client_state[_CLIENT_STATE]
                if client_state is None:
                    client_state = {}
            return None

        self._refresh_module_state()
        path, _tag, _blob = self._core.load_checkpoint(os.fspath(load_dir), tag or "", "", load_optimizer_states,
                                                       unpickle, load_lr_scheduler_states=load_lr_scheduler_states)
        if self.optimizer is not None:
            self.optimizer.pull()
        if self._client_scheduler and load_lr_scheduler_states and scheduler_state is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)
        return path, client_state

    @names_missing_ranks
    def load_pretrained(self, path, strict=True, key_mapping=None):
        """Loads pretrained weights by state-dict name from a safetensors checkpoint: a
        .safetensors file, a directory with model.safetensors, or a Hugging Face sharded one
        (model.safetensors.index.json and its shards; the directory or the index file).

        Every rank calls it between optimizer steps; each reads only the element ranges of the
        trained parameters it holds (stage 3: its shards), converted from the file's dtype, and
        buffers and frozen parameters whole. A tied weight is read from any one of its names.
        strict=True: a missing, unexpected or wrong-shaped tensor is a RuntimeError naming the
        path and listing them all, and nothing changes on any rank. strict=False loads what fits.
        key_mapping {regex: replacement}: re.sub'ed into the files' tensor names, pattern after
        pattern, before matching (as from_pretrained's key_mapping); without it a transformers
        model gets the renames of transformers' own conversion mapping (GPT-NeoX's embed_out.weight
        is lm_head.weight). Returns a zeroshard.PretrainedLoad(missing_keys, unexpected_keys,
        mismatched_keys); last_load_stats() then says what this rank read. docs/checkpoints.md."""
        self._refresh_module_state()
        path = os.fspath(path)
        loaded = self._core.load_pretrained(path, strict, _pretrained.tensor_renames(path, self.module, key_mapping))
        self._last_load_stats = {k: loaded[k] for k in ("files", "param_bytes_read", "module_state_bytes_read",
                                                         "header_bytes_read", "bytes_read")}
        return PretrainedLoad(loaded["missing"], loaded["unexpected"], loaded["mismatched"])

    def last_load_stats(self):
        """What this rank read in the last load_pretrained (None before one): files (the paths
        opened), param_bytes_read (trained parameters' tensor bytes, only the ranges this rank
        holds, in the file's dtype), module_state_bytes_read (buffers and frozen parameters),
        header_bytes_read, and bytes_read, their sum."""
        return self._last_load_stats

    def _refresh_module_state(self):
        # Buffers may have been replaced since initialize() (a reassigned attribute, a lazily
        # registered cache): the checkpoint takes the module's state as it is now.
        self._core.set_module_state_from(list(self.module.state_dict(keep_vars=True).items()))

    def set_lr(self, lr, group=-1):
        self._core.set_lr(lr, group)
        if self.optimizer is not None:
            self.optimizer.pull()

    def get_lr(self, group=0):
        return self._core.get_lr(group)

    def save_16bit_model(self, save_dir, save_filename=None, exclude_frozen_parameters=False):
        """Writes save_dir/save_filename (default model.safetensors): the model's state dict for
        inference, as DeepSpeed's save_16bit_model does: the module's own names, trained parameters
        in the compute dtype (bf16/fp16 when enabled, else fp32), buffers and frozen parameters as
        the model holds them. A ".safetensors" name writes safetensors (a tied weight once, under
        its first name, as save_pretrained does), any other (".bin") torch.save's format. Every rank
        calls it; rank 0 writes, streaming tensor by tensor (stage 3: one unit gathered at a time).
        A peft PeftModel with exclude_frozen_parameters=True writes its adapter as peft saves it:
        peft's names, default adapter_model.safetensors, and adapter_config.json (peft_adapter.py).

        Returns True when saved. At stage 3 it needs zero_optimization.
        stage3_gather_16bit_weights_on_model_save: without it nothing is written, a warning
        says so and it returns False. docs/checkpoints.md."""
        if exclude_frozen_parameters and _peft_adapter.is_peft_model(self.module):
            return _peft_adapter.save_adapter(self, os.fspath(save_dir), save_filename)
        self._refresh_module_state()
        exclude = []
        if exclude_frozen_parameters:
            exclude = [n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad]
        return _C._save_16bit_model(self._core, os.fspath(save_dir), save_filename or "model.safetensors",
                                    exclude)["saved"]

    def __getattr__(self, name):
        # stage, rank, world_size, global_steps, micro_steps, gradient_accumulation_steps,
        # train_batch_size, train_micro_batch_size_per_gpu, is_gradient_accumulation_boundary,
        # last_grad_norm come from the C++ engine.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._core, name)


def initialize(model, config, process_group=None, param_groups=None, auto=None, lr_scheduler=None, init_fn=None):
    """Wraps `model` for ZeRO training; returns an Engine.

    config: a path to a DeepSpeed-style JSON file, a dict, or a zeroshard.Config.
    process_group: the torch.distributed group to shard over (default: the world group,
      initialized from the torchrun environment if torch.distributed is not yet).
    param_groups: like a torch optimizer's, e.g. [{"params": decay}, {"params": no_decay,
      "weight_decay": 0.0}]; keys lr, weight_decay, betas, eps override the config.
    auto: values for the keys the config writes as "auto", by dotted path, e.g.
      {"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 2e-5}; the rest are derived
      (docs/config.md, "auto") or are one error naming them.
    lr_scheduler: a torch scheduler of engine.optimizer, or a callable taking engine.optimizer and
      returning one; stepped after every optimizer step taken. It replaces the config's
      `scheduler`, as in DeepSpeed.
    init_fn: for a model built on the meta device (under `with torch.device("meta"):`), which
      initialize allocates only this rank's share of and initialises module by module:
      init_fn(module) is called for every module holding parameters or buffers of its own and
      fills them in place. Default: each module's reset_parameters() (a Hugging Face model's
      _init_weights). docs/design.md, "Models on the meta device".
    """
    cfg = _load_config(config)
    if process_group is None:
        process_group = init_distributed(cfg.zeroshard.collective_timeout_seconds)
    cfg = _auto.resolve(cfg, model, auto, dist.get_world_size(process_group), dist.get_rank(process_group))
    _quantized.check_frozen_shardable(model, cfg)  # stage 3 refuses quantized frozen weights
    if lr_scheduler is not None and cfg.scheduler.enabled:
        warn_at_caller(f"zeroshard.initialize: the config's scheduler ({cfg.scheduler.type}) is not used: the "
                       "lr_scheduler passed to initialize replaces it, as in DeepSpeed")
        cfg = _C._without_scheduler(cfg)
    if lr_scheduler is not None:
        cfg = _immediate_nonfinite_check(cfg)
    meta = _meta.on_meta(model)
    if init_fn is not None and not meta:
        raise ValueError("zeroshard.initialize: init_fn initialises a model built on the meta device, but this "
                         f"model's parameters are on {next(model.parameters()).device}: build it under "
                         "`with torch.device(\"meta\"):`, or initialise it yourself and leave init_fn out")
    groups = _param_groups(model, param_groups)
    # Frozen parameters (requires_grad=False, e.g. a LoRA base) are sharded with their units at
    # stage 3 and kept whole below it; every rank starts from rank 0's (engine.h).
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    meta_init = {}
    if meta:
        device = _meta.engine_device(process_group)
        steps = _meta.init_steps(model, groups, device, init_fn, frozen if cfg.params_sharded else None)
        meta_init = dict(init_device=str(device), init_steps=steps)
    hooks = []
    if cfg.bf16_enabled or cfg.fp16_enabled:
        # The parameters become 16-bit; floating-point inputs are cast to match, as FSDP's
        # MixedPrecisionPolicy does. Buffers keep their dtype.
        dtype = torch.bfloat16 if cfg.bf16_enabled else torch.float16
        hooks.append(model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))
    if not cfg.params_sharded:
        core = _C.Engine(groups, process_group.group_name, cfg, frozen=frozen, **meta_init)
    else:
        units = stage3.find_units(model, cfg.zeroshard.stage3_unit_classes)
        core = _C.Engine(groups, process_group.group_name, cfg, stage3.unit_specs(model, units), frozen=frozen,
                         **meta_init)
        hooks += stage3.install_hooks(core, model, units)
    trained = {id(p): n for g in groups for n, p in zip(g["names"], g["params"])}
    core.set_module_state_from(list(model.state_dict(keep_vars=True).items()))
    if not meta:
        core.broadcast_module_state()  # buffers and whole frozen parameters, as rank 0 has them
    optimizer = EngineOptimizer(core, groups, cfg)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        if not callable(lr_scheduler):
            raise TypeError("zeroshard.initialize: lr_scheduler must be a scheduler (with step()) or a callable "
                            f"taking the optimizer, not {type(lr_scheduler).__name__}")
        lr_scheduler = lr_scheduler(optimizer)
    wire_logging(core)
    engine = Engine(model, core, cfg, hooks, trained, optimizer, lr_scheduler)
    if lr_scheduler is None and cfg.scheduler.enabled:
        engine.lr_scheduler = ConfigSchedule(core)  # stepped in C++, shown as DeepSpeed's object
    return engine


# With a scheduler passed to initialize, the saved client state is a dict of these two keys.
_CLIENT_STATE = "__zeroshard_client_state__"
_CLIENT_SCHEDULER = "__zeroshard_lr_scheduler__"


def _immediate_nonfinite_check(cfg):
    """A torch scheduler steps right after the optimizer step, and cannot be rewound when the
    deferred check finds that step skipped a step later: with one, the check is immediate
    (docs/reliability.md)."""
    check = cfg.zeroshard.nonfinite_check
    if cfg.zeroshard.nonfinite == "off" or cfg.fp16_enabled:
        return cfg  # nothing is checked late: no check, or fp16's loss scaler at the step
    if check == "deferred":
        raise ValueError("zeroshard.nonfinite_check: \"deferred\" cannot be used with the lr_scheduler passed to "
                         "zeroshard.initialize: a torch scheduler steps after every optimizer step and cannot be "
                         "taken back when the step turns out skipped a step later; use \"auto\" or \"immediate\" "
                         "(an immediate check, a host synchronisation per step on a GPU), or the config's "
                         "\"scheduler\" (rewound in C++) instead of lr_scheduler")
    return _C._with_immediate_nonfinite_check(cfg) if check == "auto" else cfg


def _client_state_bytes(client_state):
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    blob = buffer.getvalue()
    # load_checkpoint reads it with weights_only=True: refuse now what it would refuse then.
    torch.load(io.BytesIO(blob), weights_only=True)
    return blob


def _cast_inputs(dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(_module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook
