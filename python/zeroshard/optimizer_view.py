"""engine.optimizer: the engine's sharded AdamW as torch schedulers see it.

It is a torch.optim.Optimizer whose param_groups hold each group's parameters and its lr,
betas, eps and weight_decay, so torch.optim.lr_scheduler classes and the Hugging Face
get_*_schedule_with_warmup helpers accept it. The update itself runs in C++ (engine.step());
this object only carries the hyper-parameters across: before every optimizer step the engine
takes each group's lr from here, and after it writes back the lr the step used (a config
`scheduler` moves it in C++)."""

import torch


class EngineOptimizer(torch.optim.Optimizer):
    def __init__(self, core, groups, cfg):
        o = cfg.optimizer
        param_groups = []
        for g in groups:
            param_groups.append({
                "params": list(g["params"]),
                "lr": g.get("lr", o.lr),
                "betas": tuple(g.get("betas", o.betas)),
                "eps": g.get("eps", o.eps),
                "weight_decay": g.get("weight_decay", o.weight_decay),
            })
        defaults = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        super().__init__(param_groups, defaults)
        self._core = core
        self._stepping = False
        self._mirrored = []
        self.pull()

    def pull(self):
        """The lr the engine holds, into param_groups (after a step, or set_lr)."""
        self._mirrored = [self._core.get_lr(i) for i in range(len(self.param_groups))]
        for group, lr in zip(self.param_groups, self._mirrored):
            group["lr"] = lr

    def push(self):
        """Each group's lr, where a scheduler or the user changed it here, into the engine."""
        for i, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            if lr != self._mirrored[i]:
                self._core.set_lr(lr, i)
                self._mirrored[i] = lr

    def step(self, closure=None):
        # Called by engine.step() at the boundary, so that torch schedulers see the optimizer
        # step they expect before theirs; the update ran in C++ already.
        if not self._stepping:
            raise RuntimeError("zeroshard: engine.optimizer.step() is not for user code: engine.step(), "
                               "called after every backward, steps the sharded optimizer at the "
                               "gradient accumulation boundary")
        return None

    def zero_grad(self, set_to_none=True):
        """Nothing to do: after each optimizer step the engine starts the next window afresh
        (every .grad None until a backward writes it; Note [first gradient of a window]), and
        inside a window the .grad tensors at stages 0-1 are views of its flat buffer, which must
        stay."""

    def _stepped(self):
        self._stepping = True
        try:
            self.step()
        finally:
            self._stepping = False
