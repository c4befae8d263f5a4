"""engine.lr_scheduler for a config `scheduler`: what DeepSpeed's scheduler object shows user
code, over the schedule that runs in C++ (csrc/zeroshard/optim/lr_schedule.h).

The engine steps it after every optimizer step taken, as DeepSpeed's engine steps its
lr_scheduler, so user code only reads it (and checkpoints hold its state already)."""


class ConfigSchedule:
    """DeepSpeed's LRRangeTest / OneCycle / WarmupLR / WarmupDecayLR / WarmupCosineLR as the
    config's "scheduler" section made it; the engine owns and steps it."""

    def __init__(self, core):
        if not core.lr_schedule_type:
            raise ValueError("zeroshard: the config has no \"scheduler\"")
        self._core = core

    @property
    def type(self):
        """The scheduler's name, as written in the config ("WarmupLR", ...)."""
        return self._core.lr_schedule_type

    @property
    def last_batch_iteration(self):
        """-1 before the first optimizer step (unless the config set it), +1 after each."""
        return self._core.lr_schedule_last_batch_iteration

    def get_lr(self):
        """The schedule's lr per param group at last_batch_iteration (DeepSpeed's get_lr())."""
        return self._core.lr_schedule_lrs()

    def get_last_lr(self):
        """Each param group's lr as the schedule last set it, which the next optimizer step uses."""
        return self._core.get_lrs()

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        """As DeepSpeed's: the schedule continues from state_dict["last_batch_iteration"]; the
        param groups keep their lr until its next step."""
        self._core.load_lr_schedule_state(int(state_dict["last_batch_iteration"]))

    def step(self, *args, **kwargs):
        # DeepSpeed's engine steps its scheduler too, and a script that also calls step()
        # advances it twice per optimizer step without a word; here that is an error.
        raise RuntimeError(
            "zeroshard: the config's scheduler (" + self.type + ") is stepped by engine.step() after every "
            "optimizer step (as DeepSpeed's engine steps it); calling lr_scheduler.step() as well would "
            "advance it twice per step. Remove the call, or pass your own scheduler to zeroshard.initialize "
            "(lr_scheduler=...) and leave \"scheduler\" out of the config")

    def __repr__(self):
        return f"ConfigSchedule({self.type}, last_batch_iteration={self.last_batch_iteration})"
