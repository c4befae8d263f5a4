"""The Engine a training script talks to (zeroshard.initialize() builds it: initialization.py).

The work happens in C++ (zeroshard._C.Engine); this layer only forwards calls.
"""

import collections
import contextlib
import io
import os

import torch

from zeroshard import _C
from zeroshard._destroyed import Destroyed
from zeroshard.lr_schedule import ConfigSchedule
from zeroshard import peft_adapter as _peft_adapter
from zeroshard import pretrained as _pretrained
from zeroshard.pretrained import PretrainedLoad
from zeroshard.peers import names_missing_ranks


class Engine:
    """Runs the model and its ZeRO-sharded training step (see zeroshard.initialize)."""

    def __init__(self, module, core, config, hooks=(), trained=None, optimizer=None, lr_scheduler=None, units=None):
        self.module = module
        self._units = units  # stage 3's [(name, module)]; None below stage 3
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
            # The forward's span in a torch.profiler trace (Note [profiler names], engine.cpp).
            with torch.profiler.record_function("zeroshard::forward"):
                return self.module(*args, **kwargs)
        finally:
            self._core.end_forward()

    forward = __call__

    @names_missing_ranks
    def backward(self, loss, scale_wrt_gas=True):
        """Backpropagates loss / gradient_accumulation_steps and reduces the gradients.

        scale_wrt_gas=False backpropagates the loss as given (DeepSpeed's flag), for a caller that
        scales it itself, e.g. by the length of a window it ended early; fp16's loss scale is
        applied either way. Whether this micro-step ends the accumulation window is decided here
        (is_gradient_accumulation_boundary), and the step() after it follows that decision."""
        self._core.backward(loss, scale_wrt_gas=bool(scale_wrt_gas))

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's set_gradient_accumulation_boundary: True or False decides whether each
        following micro-step ends the accumulation window (its backward reduces the gradients for
        the optimizer, its step() steps), until set again; None returns to counting
        gradient_accumulation_steps micro-steps from the last boundary. The Hugging Face Trainer
        sets it on every micro-step, True on the last of a window it ends early (the end of an
        epoch that does not divide by the accumulation steps); the next window then counts from
        there. Set it before the micro-step's backward: a micro-step whose backward ran keeps the
        decision that backward took. Every rank sets the same."""
        self._core.set_gradient_accumulation_boundary(None if is_boundary is None else bool(is_boundary))

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

    def compile(self, backend=None, **compile_kwargs):
        """Compiles each unit's forward in place with torch.compile(backend=backend,
        **compile_kwargs), at any stage (backend None: the config's compile.backend, default
        "inductor"; the config's compile.kwargs are the defaults of compile_kwargs); zeroshard's
        hooks (stage 3's gathers and releases, the gradient reductions) stay outside the graphs and run as they do eagerly (Note [hooks
        outside the graphs], zeroshard/compiled.py). The units are stage 3's (below stage 3 found
        by the same rule: zeroshard.stage3_unit_classes, or the children of the largest
        nn.ModuleList; a model with none is compiled whole). Call it once, after initialize,
        on every rank (initialize calls it when the config's compile.enabled is true); the first
        step compiles. Returns the names of the compiled modules."""
        from zeroshard import compiled

        section = self.config.compile
        units = compiled.units_of(self._units, self.module, self.config.zeroshard.stage3_unit_classes)
        return compiled.compile_units(self.module, units, section.backend if backend is None else backend,
                                      **{**section.kwargs, **compile_kwargs})

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
        return _C._save_16bit_model(self._core, os.fspath(save_dir), save_filename or "model.safetensors",
                                    self._frozen_names(exclude_frozen_parameters))["saved"]

    @names_missing_ranks
    def consolidated_state_dict(self, exclude_frozen_parameters=False):
        """The model's state dict with whole tensors on CPU, on rank 0; None on the other ranks.

        What save_16bit_model would write, as a dict (DeepSpeed's
        _zero3_consolidated_16bit_state_dict): an OrderedDict of every state_dict name in the
        module's order, the trained parameters in the compute dtype (bf16/fp16 when enabled,
        else fp32), buffers and frozen parameters as the model holds them; a tied weight under
        each of its names, one tensor, as in the module's state_dict(). Each tensor is a new CPU
        copy. exclude_frozen_parameters=True leaves out the parameters with requires_grad=False
        (a LoRA base), under every name. Every rank calls it, outside forward and backward. At
        stage 3 the units are gathered one at a time (never the whole model), with or without
        stage3_gather_16bit_weights_on_model_save; rank 0 then holds the whole state dict in CPU
        memory. docs/checkpoints.md."""
        self._refresh_module_state()
        result = _C._consolidated_16bit_state_dict(self._core, self._frozen_names(exclude_frozen_parameters))
        if result["state_dict"] is None:
            return None
        return collections.OrderedDict(result["state_dict"])

    def _frozen_names(self, exclude):
        if not exclude:
            return []
        return [n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def destroy(self):
        """Releases the engine: removes the hooks zeroshard put on the model (stage 3's unit hooks,
        the input cast of bf16/fp16) and drops the C++ engine, freeing its flat buffers,
        gradients, optimizer state and master weights. Any later use of the engine (or of its
        optimizer and config scheduler) is a RuntimeError saying it was destroyed. The model is
        left as it is: below stage 3 its parameters keep the last weights (their gradients are
        dropped); at stage 3 they hold no data (their shards went with the engine), so save what
        you need first (save_16bit_model, consolidated_state_dict, save_checkpoint). Call it on
        every rank, as DeepSpeed's; a second call does nothing."""
        if isinstance(self._core, Destroyed):
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        # Stages 0-1 make each .grad a view of the engine's flat gradient buffer, which would
        # outlive the engine through it.
        for p in self.module.parameters():
            if id(p) in self._trained:
                p.grad = None
        gone = Destroyed("this zeroshard engine", "build a new one with zeroshard.initialize()")
        # Every Python holder of the C++ engine lets go of it, so that it is deleted here.
        if self.optimizer is not None:
            self.optimizer._core = gone
        if isinstance(self.lr_scheduler, ConfigSchedule):
            self.lr_scheduler._core = gone
        self._core = gone
        self.clock_client_state = None

    def __getattr__(self, name):
        # stage, rank, world_size, global_steps, micro_steps, gradient_accumulation_steps,
        # train_batch_size, train_micro_batch_size_per_gpu, is_gradient_accumulation_boundary,
        # last_grad_norm come from the C++ engine.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._core, name)


# With a scheduler passed to initialize, the saved client state is a dict of these two keys.
_CLIENT_STATE = "__zeroshard_client_state__"
_CLIENT_SCHEDULER = "__zeroshard_lr_scheduler__"


def _client_state_bytes(client_state):
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    blob = buffer.getvalue()
    # load_checkpoint reads it with weights_only=True: refuse now what it would refuse then.
    torch.load(io.BytesIO(blob), weights_only=True)
    return blob
