"""What the Hugging Face Trainer holds in place of its model wrapper, optimizer, scheduler and
accelerator when zeroshard trains (trainer.py builds them).

Note [the Trainer's step through the engine]: the Trainer's loop calls, per micro-batch,
training_step -> accelerator.backward(loss), and at the accumulation boundary
clip -> optimizer.step() -> lr_scheduler.step() -> model.zero_grad(). Under zeroshard the whole
step is the engine's, at the backward, as under DeepSpeed: `ShardedAccelerator.backward` tells the
engine whether this micro-batch ends the window (the Trainer's own `sync_gradients`, so a short
last window of an epoch ends where the Trainer says), runs the engine's backward and its step,
which clips, steps AdamW and then the learning-rate schedule. What the loop calls afterwards
only reads what happened: the clip returns the engine's gradient norm, optimizer.step() and
lr_scheduler.step() do nothing, get_last_lr() is the lr the step used (what the plain Trainer
logs), and zero_grad() leaves the engine's flat gradient buffers alone. Every Trainer subclass
that ends its training_step in accelerator.backward (TRL's among them) trains this way.
"""

import contextlib

import torch
from accelerate import Accelerator


class EngineModule(torch.nn.Module):
    """The Trainer's `model_wrapped`: calls go through the engine (its forward timing), and
    attributes it lacks come from the model, as DeepSpeed's engine does."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        self._engine = engine  # not a Module: a plain attribute

    def forward(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def zero_grad(self, set_to_none=True):
        """Nothing to do: after each optimizer step the engine starts the next window afresh
        (every .grad None until a backward writes it), and inside a window the parameters' .grad
        at stages 0-1 are views of its flat buffer, which must stay."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("_"):
                raise
            return getattr(module, name)


class StepView:
    """The Trainer's `optimizer`: the engine's param groups (lr, betas, eps, weight decay), with a
    step() that does nothing, since the engine stepped at the backward (Note [the Trainer's step
    through the engine]). Not a torch Optimizer, so accelerate's prepare() leaves it as it is."""

    def __init__(self, engine_optimizer):
        self._inner = engine_optimizer

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def defaults(self):
        return self._inner.defaults

    @property
    def state(self):
        return self._inner.state

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none=True):
        pass

    def state_dict(self):
        # The AdamW state is in the engine's checkpoint; this is the hyper-parameters only.
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        """Each group's lr (the AdamW state comes from the engine's checkpoint)."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group["lr"] = saved["lr"]


class ScheduleView:
    """The Trainer's `lr_scheduler`: the schedule the engine steps (the Trainer's own, built on the
    engine's optimizer, or the config's `scheduler`), seen from the loop."""

    def __init__(self, run):
        self._run = run

    @property
    def _schedule(self):
        return self._run.engine.lr_scheduler

    def step(self, *args, **kwargs):
        pass  # the engine steps the schedule after each optimizer step it takes

    def get_last_lr(self):
        """Each group's lr in the last optimizer step (the plain Trainer logs it after its optimizer
        step and before its scheduler step); before any step, the lr of the first."""
        used = self._run.last_step_lrs
        return list(used) if used is not None else [g["lr"] for g in self._run.engine.optimizer.param_groups]

    def state_dict(self):
        return self._schedule.state_dict()

    def load_state_dict(self, state_dict):
        self._schedule.load_state_dict(state_dict)


class ShardedAccelerator(Accelerator):
    """The Trainer's accelerator with the training step routed through the engine (Note [the
    Trainer's step through the engine]); everything else is accelerate's. Trainer.
    create_accelerator_and_postprocess builds a plain Accelerator, and trainer.py makes it this
    class (`_zeroshard_run` is then set), so accelerate keeps its own construction."""

    def backward(self, loss, **kwargs):
        # accelerate's own rule (the Trainer sets its accumulation to 1 and scales the loss itself).
        loss = loss / self.gradient_accumulation_steps
        self._zeroshard_run.backward_and_step(loss, boundary=self.sync_gradients)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clipped at its step (gradient_clipping = max_grad_norm); this is the norm
        before clipping, as torch's clip_grad_norm_ returns it (None without clipping)."""
        return self._zeroshard_run.last_grad_norm()

    def unwrap_model(self, model, keep_fp32_wrapper=True, keep_torch_compile=True):
        if isinstance(model, EngineModule):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def no_sync(self, model):
        return contextlib.nullcontext()  # the engine reduces only at the boundary it was told

    @property
    def optimizer_step_was_skipped(self):
        return self._zeroshard_run.last_step_skipped
