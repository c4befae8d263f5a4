"""DeepSpeedEngine: DeepSpeed's engine API (deepspeed/runtime/engine.py) over a zeroshard Engine.

It is an nn.Module holding the model as `module`, as DeepSpeed's is (so `engine.parameters()`
and `engine.state_dict()` carry the "module." prefix, and attributes it lacks are looked up on
the model). The counters are DeepSpeed's: `micro_steps` counts step() calls, `global_steps`
and `global_samples` rise at each accumulation boundary (also one that fp16 skipped, as in
DeepSpeed), and they travel in checkpoints.
"""

import functools
import os

import torch
import torch.distributed as dist

from zeroshard._destroyed import Destroyed
from zeroshard.compiled import is_compiled
from zeroshard._warnings import warn_at_caller
from zeroshard.peft_adapter import is_peft_model

# Where the drop-in keeps DeepSpeed's counters inside zeroshard's client state.
_STATE_KEY = "zeroshard.deepspeed"


def _needs_engine(method):
    """For the methods that would otherwise answer from what the engine left behind after
    destroy() (the model, the optimizer's param_groups, the config dict): the same error as a
    call that reaches the destroyed engine."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        engine = self.__dict__.get("_engine")
        if isinstance(engine, Destroyed):
            raise engine.error(method.__name__)
        return method(self, *args, **kwargs)

    return checked


class DeepSpeedEngine(torch.nn.Module):
    def __init__(self, engine, config, group, training_dataloader=None):
        super().__init__()
        self.module = engine.module
        self._engine = engine  # zeroshard.Engine (not a Module: a plain attribute)
        self._group = group
        self.config = config  # the config dict, as DeepSpeed's engine.config
        self.optimizer = engine.optimizer
        self.lr_scheduler = engine.lr_scheduler
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.global_rank = dist.get_rank()
        self.world_size = self.dp_world_size = dist.get_world_size(group)
        self._step_applied = False
        # After a backward not followed by step() yet: whether it ended the window (else None).
        self._unstepped = None
        self._gathered_depth = 0
        self._gathered = None
        # The engine's parameter order, which every rank shares (GatheredParameters broadcasts in it).
        self._param_order = {id(p): i for i, p in enumerate(self.module.parameters())}

    def __getattr__(self, name):
        # As DeepSpeed: what the engine does not have, the model may.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and not name.startswith("_"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    @property
    def device(self):
        return next(self.module.parameters()).device

    @property
    def skipped_steps(self):
        return self._engine.skipped_steps

    @_needs_engine
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Backpropagates loss / gradient_accumulation_steps (loss itself with scale_wrt_gas=False)
        and reduces the gradients; returns the loss so scaled, as DeepSpeed does."""
        if retain_graph:
            raise NotImplementedError("zeroshard.deepspeed: engine.backward(retain_graph=True) is not supported")
        if self._unstepped is not None:
            # accelerate steps only at a boundary (DeepSpeedEngineWrapper.backward), which
            # DeepSpeed allows: the micro-step it left is finished here. One that ended a window
            # holds an optimizer step that must not run late.
            if self._unstepped:
                raise RuntimeError("zeroshard.deepspeed: engine.backward() called again after a backward that ended "
                                   "an accumulation window, without engine.step() between: call engine.step() "
                                   "after that backward (it takes the optimizer step)")
            self._engine.step()
        self._engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        self._unstepped = self.is_gradient_accumulation_boundary()  # the decision this backward took
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self, lr_kwargs=None):
        """Call after every backward (or, as accelerate does, only after the backward that ends
        the window): at the accumulation boundary the optimizer steps, then the learning-rate
        schedule."""
        if lr_kwargs is not None:
            raise NotImplementedError("zeroshard.deepspeed: engine.step(lr_kwargs=...) is not supported")
        # After the backward: the decision it took, which the step follows (a boundary set since
        # applies from the next micro-step).
        boundary = self.is_gradient_accumulation_boundary()
        self._unstepped = None
        stepped = self._engine.step()
        self._step_applied = bool(stepped)
        if boundary:
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    @_needs_engine
    def was_step_applied(self):
        return self._step_applied

    @_needs_engine
    def zero_grad(self, set_to_none=True):
        """Nothing to do: after each optimizer step the engine starts the next window afresh (every
        .grad None until a backward writes it), and holds the gradients in its own flat buffers
        between micro-batches."""

    def is_gradient_accumulation_boundary(self):
        """Whether the coming micro-step (after its backward: this one) ends the accumulation
        window: the value set_gradient_accumulation_boundary set, else whether the window has
        gradient_accumulation_steps micro-steps with it, which is DeepSpeed's
        (micro_steps + 1) % gradient_accumulation_steps == 0 unless a window was ended early."""
        return self._engine.is_gradient_accumulation_boundary

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's: True or False decides whether each following micro-step ends the
        accumulation window, until set again (None: count gradient_accumulation_steps
        micro-steps from the last boundary). accelerate sets it before every backward from the
        Trainer's sync_gradients (zeroshard.Engine.set_gradient_accumulation_boundary)."""
        self._engine.set_gradient_accumulation_boundary(is_boundary)

    def train_batch_size(self):
        return self._engine.train_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self._engine.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self):
        return self._engine.gradient_accumulation_steps

    def zero_optimization_stage(self):
        return self._engine.stage

    def zero_optimization(self):
        return self._engine.stage > 0

    def zero_optimization_partition_gradients(self):
        return self._engine.stage >= 2

    def zero_optimization_partition_weights(self):
        return self._engine.stage >= 3

    def fp16_enabled(self):
        return self._engine.config.fp16_enabled

    def bfloat16_enabled(self):
        return self._engine.config.bf16_enabled

    @_needs_engine
    def gradient_clipping(self):
        return self.config.get("gradient_clipping", 0.0)

    def get_global_grad_norm(self):
        return self._engine.last_grad_norm

    @_needs_engine
    def get_lr(self):
        """Each param group's learning rate, as the next optimizer step will use it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    @_needs_engine
    def get_mom(self):
        return [group["betas"] for group in self.optimizer.param_groups]

    @_needs_engine
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Saves a sharded checkpoint to save_dir/tag (default "global_step<global_steps>"); every
        rank calls it between optimizer steps. Returns True, as DeepSpeed does."""
        if not save_dir:
            raise ValueError(f"zeroshard.deepspeed: save_dir must be a non-empty path, got {save_dir!r}")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        state = dict(client_state or {})
        state[_STATE_KEY] = {"global_steps": self.global_steps, "global_samples": self.global_samples}
        latest = os.path.join(os.fspath(save_dir), "latest")
        previous = _read_bytes(latest) if not save_latest and self.global_rank == 0 else None
        self._engine.save_checkpoint(save_dir, tag=tag, client_state=state,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
        if not save_latest:
            # zeroshard always points `latest` at what it published; put back what was there.
            if self.global_rank == 0:
                _restore_bytes(latest, previous)
            dist.barrier(self._group)
        return True

    @_needs_engine
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Loads load_dir/tag (default: the one `latest` names) at any world size and stage.
        Returns (path, client_state), or (None, None) with a warning when there is no `latest`
        to follow, as DeepSpeed does. load_module_only: the weights only (no optimizer,
        schedule or counters)."""
        if custom_load_fn is not None:
            raise NotImplementedError("zeroshard.deepspeed: load_checkpoint(custom_load_fn=...) is not supported")
        if tag is None and not os.path.isfile(os.path.join(os.fspath(load_dir), "latest")):
            warn_at_caller(f"zeroshard.deepspeed: no checkpoint to load: {os.path.join(load_dir, 'latest')} does not "
                           "exist (pass a tag to load a particular one)")
            return None, None
        path, client_state = self._engine.load_checkpoint(
            load_dir, tag=None if tag is None else str(tag),
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)
        counters = client_state.pop(_STATE_KEY, None) if isinstance(client_state, dict) else None
        if not load_module_only:
            if counters is None:  # saved by plain zeroshard: DeepSpeed's own fallback for samples
                counters = {"global_steps": self._engine.global_steps,
                            "global_samples": self._engine.global_steps * self.train_batch_size()}
            self.global_steps = counters["global_steps"]
            self.global_samples = counters["global_samples"]
        return path, client_state

    def save_16bit_model(self, save_dir, save_filename=None, exclude_frozen_parameters=False):
        """Rank 0 writes the model's weights in the compute dtype under its state_dict names (a
        torch file for .bin names, safetensors for .safetensors; default DeepSpeed's
        pytorch_model.bin). Returns True, or False with a warning at stage 3 without
        stage3_gather_16bit_weights_on_model_save. Every rank calls it. A peft PeftModel with
        exclude_frozen_parameters=True writes its adapter as peft saves it (peft's names, default
        adapter_model.safetensors, adapter_config.json: zeroshard.Engine.save_16bit_model)."""
        if save_filename is None and not (exclude_frozen_parameters and is_peft_model(self.module)):
            save_filename = "pytorch_model.bin"
        return self._engine.save_16bit_model(save_dir, save_filename=save_filename,
                                             exclude_frozen_parameters=exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's: the model's state dict (its own names, every one; trained parameters in the
        compute dtype) as an OrderedDict of whole CPU tensors on global rank 0, None on the other
        ranks. Every rank calls it. At stage 3 it gathers one unit at a time, with or without
        stage3_gather_16bit_weights_on_model_save (which only save_16bit_model checks); it works at
        the other stages too. exclude_frozen_parameters=True leaves out the parameters with
        requires_grad=False, as the Hugging Face Trainer asks for a peft model
        (zeroshard.Engine.consolidated_state_dict)."""
        return self._engine.consolidated_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self):
        """The config's zero_optimization.stage3_gather_16bit_weights_on_model_save (or its alias
        stage3_gather_fp16_weights_on_model_save); False when not set."""
        return self._engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def compile(self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled=False):
        """DeepSpeed's engine.compile: each unit's forward compiled in place with
        torch.compile(backend=backend, **compile_kwargs), zeroshard's hooks outside the graphs
        (zeroshard.Engine.compile; backend None: the config's compile.backend, "inductor" unless
        set). DeepCompile's `schedule` (its compiler passes over ZeRO-3)
        and compiled autograd are not implemented: passing them is an error, not a silent
        eager run."""
        if schedule is not None:
            raise NotImplementedError("zeroshard.deepspeed: engine.compile(schedule=...) is DeepCompile's pass "
                                      "schedule, which zeroshard does not implement; call compile() without it "
                                      "(each unit's forward is compiled, the sharding stays zeroshard's)")
        if compiled_autograd_enabled:
            raise NotImplementedError("zeroshard.deepspeed: engine.compile(compiled_autograd_enabled=True) is not "
                                      "implemented: the backward's hooks (reductions, stage 3's gathers) run "
                                      "eagerly around each unit's compiled backward")
        self._engine.compile(backend=backend, **(compile_kwargs or {}))

    @property
    def is_compiled(self):
        """DeepSpeed's: whether compile() was called."""
        return any(is_compiled(m) for m in self._engine.module.modules())

    def destroy(self):
        """DeepSpeed's: releases the engine. The hooks zeroshard put on the model are removed and the
        zeroshard engine with its sharded state is freed (zeroshard.Engine.destroy); any later call
        on this engine raises a RuntimeError saying it was destroyed. The model stays: its weights
        as trained below stage 3, no data in its parameters at stage 3 (save them first). Every rank
        calls it; a second call does nothing."""
        if isinstance(self._engine, Destroyed):
            return
        if self._gathered_depth:
            raise RuntimeError("zeroshard.deepspeed: destroy() inside deepspeed.zero.GatheredParameters; leave the "
                               "context first")
        self._engine.destroy()
        self._unstepped = None  # a window left open has nothing left to step
        self._engine = Destroyed("this zeroshard.deepspeed engine", "build a new one with deepspeed.initialize()")

    # GatheredParameters (zero.py) calls these.
    def _enter_gathered(self):
        if self._gathered_depth == 0:
            self._gathered = self._engine.gathered_parameters()
            self._gathered.__enter__()
        self._gathered_depth += 1

    def _exit_gathered(self):
        self._gathered_depth -= 1
        if self._gathered_depth == 0:
            gathered, self._gathered = self._gathered, None
            gathered.__exit__(None, None, None)

    def _write_back(self, named, modifier_rank):
        if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < self.world_size:
            raise ValueError(f"zeroshard.deepspeed: GatheredParameters modifier_rank={modifier_rank!r} is not a rank "
                             f"of this engine's group (0..{self.world_size - 1})")
        named = sorted(named, key=lambda item: self._param_order[id(item[1])])
        src = dist.get_global_rank(self._group, modifier_rank)
        _broadcast_coalesced([p.data for _, p in named], src, self._group)
        # Trained and frozen: at stage 3 both are sharded, and the gathered copy is released on exit.
        self._engine.set_parameters([(name, p.data) for name, p in named])


def _broadcast_coalesced(tensors, src, group):
    """One broadcast per dtype and device, through a flat buffer."""
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _restore_bytes(path, text):
    # Written aside and renamed over, so `latest` is never seen half written.
    if text is None:
        if os.path.exists(path):
            os.remove(path)
        return
    staging = path + ".restore"
    with open(staging, "wb") as f:
        f.write(text)
    os.replace(staging, path)
