"""What initialize() returns as lr_scheduler for the config's `scheduler` when zeroshard's
engine offers none itself: a view of the schedule that the C++ engine steps (once per optimizer
step taken, at the boundary), with DeepSpeed's lr_schedules methods for reading and
checkpointing it. Stepping belongs to engine.step(), so step() here is refused rather than
stepping the schedule twice."""


class ConfigSchedule:
    def __init__(self, engine):
        self._engine = engine  # zeroshard.Engine: its lr_schedule_* come from the C++ engine
        self.type = engine.lr_schedule_type

    @property
    def last_batch_iteration(self):
        return self._engine.lr_schedule_last_batch_iteration

    def get_lr(self):
        return list(self._engine.lr_schedule_lrs())

    def get_last_lr(self):
        return self.get_lr()

    def step(self, *args, **kwargs):
        raise RuntimeError(f"zeroshard.deepspeed: the config's {self.type} is stepped by engine.step() at each "
                           "accumulation boundary, as in DeepSpeed; do not step it yourself")

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self._engine.load_lr_schedule_state(int(state["last_batch_iteration"]))

    def __repr__(self):
        return f"ConfigSchedule({self.type}, last_batch_iteration={self.last_batch_iteration})"


def config_schedule_of(engine):
    """engine.lr_scheduler, or a ConfigSchedule where the config has a scheduler and the engine
    gives no object for it."""
    if engine.lr_scheduler is not None or not engine.lr_schedule_type:
        return engine.lr_scheduler
    return ConfigSchedule(engine)
