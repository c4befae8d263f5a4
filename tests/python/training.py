"""What the engine tests train with and are held to: the engine config, the loop over the global
batches, and single-process torch.optim.AdamW on the same batches (the reference).

The memory formulas are benchmarks/model_state.py's (on sys.path through conftest.py): the
benchmarks print the same ones, and import nothing from here.
"""

import torch

from models import global_batch, make_model

MICRO = 2          # sequences per rank per micro-step
LR = 1e-2
WEIGHT_DECAY = 0.05


def engine_config(stage, *, lr=LR, weight_decay=WEIGHT_DECAY, micro=MICRO, gas=None, clip=None,
                  precision="fp32", loss_scaling=None, zero=None, zeroshard=None, timeout=30):
    """A zeroshard config that holds exactly the keys a test sets: `None` leaves a key (or, for
    weight_decay and timeout, the whole AdamW weight decay or "zeroshard" section) to the
    engine's default. zero: further "zero_optimization" keys; zeroshard: further "zeroshard"
    keys besides collective_timeout_seconds; loss_scaling: the "fp16" keys besides "enabled"."""
    assert precision in ("fp32", "bf16", "fp16"), precision
    assert loss_scaling is None or precision == "fp16", "loss scaling is fp16's"
    params = {"lr": lr} if weight_decay is None else {"lr": lr, "weight_decay": weight_decay}
    config = {"train_micro_batch_size_per_gpu": micro,
              "optimizer": {"type": "AdamW", "params": params},
              "zero_optimization": {"stage": stage, **(zero or {})}}
    if gas is not None:
        config["gradient_accumulation_steps"] = gas
    if clip is not None:
        config["gradient_clipping"] = clip
    extras = ({} if timeout is None else {"collective_timeout_seconds": timeout}) | (zeroshard or {})
    if extras:
        config["zeroshard"] = extras
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, **(loss_scaling or {})}
    return config


def train_global_batches(model, engine, rank, world_size, steps, micro=MICRO, before_step=None, after_step=None):
    """Runs one engine step per entry of `steps` on global_batch(step, micro x world_size x
    gradient_accumulation_steps): rank r takes micro-batch m x world_size + r at micro-step m,
    and engine.step() must report a step at the accumulation boundary only. before_step(step,
    tokens) sees each global batch first. The batches go to the device of the model's
    parameters (a stage-3 parameter keeps its device while it holds no storage). Returns each
    step's loss averaged over the global batch (every rank and micro-batch)."""
    import torch.distributed as dist

    gas = engine.gradient_accumulation_steps
    device = next(model.parameters()).device
    losses = []
    for step in steps:
        tokens = global_batch(step, micro * world_size * gas).to(device)
        if before_step is not None:
            before_step(step, tokens)
        total = torch.zeros((), device=device)
        for m in range(gas):
            start = (m * world_size + rank) * micro
            loss = model.loss(tokens[start:start + micro])
            engine.backward(loss)
            assert engine.step() == (m == gas - 1)
            total += loss.detach().float()
        if after_step is not None:
            after_step()
        dist.all_reduce(total)
        losses.append(total.item() / (world_size * gas))
    return losses


def no_decay_groups(model, no_decay_lr=2e-3):
    """The usual split of the trained parameters: no weight decay (and here another lr) for
    biases and norm weights."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.ndim >= 2]},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0, "lr": no_decay_lr}]


class AdamWReference:
    """Single-process torch.optim.AdamW on the whole batch of each step.

    fp32: every trained parameter starts with a zero gradient that is zeroed, never dropped,
    between steps, so a parameter that gets no gradient in a step counts as a zero gradient (it
    still moves by its momentum and weight decay), as in the engine's flat gradient buffers.
    bf16: the engine's mixed-precision recipe in plain torch: the model computes in bf16, an fp32
    master copy taken before the cast takes the AdamW step, and the bf16 weights are refreshed
    from it. fp16: the same in fp16, with a static loss_scale: the fp32 loss times the scale is
    backpropagated and the gradients are divided by it in fp32 (the engine's dynamic scale while
    nothing overflows). loss(model, batch) defaults to model.loss(batch)."""

    def __init__(self, model, lr=LR, weight_decay=WEIGHT_DECAY, clip=0.0, groups=None, precision="fp32",
                 loss=None, loss_scale=None):
        assert precision in ("fp32", "bf16", "fp16"), precision
        assert (loss_scale is not None) == (precision == "fp16"), "fp16 takes a loss scale, the others none"
        assert not (clip and precision == "fp16"), "clipping would read the scaled fp16 gradients"
        self.model, self.clip, self.precision, self.loss_scale = model, clip, precision, loss_scale
        self.loss = loss or (lambda m, tokens: m.loss(tokens))
        if precision != "fp32":
            assert groups is None, "one param group with a master copy"
            self.masters = [p.detach().clone().requires_grad_() for p in model.parameters() if p.requires_grad]
            model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
            self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.trained = [p for p in model.parameters() if p.requires_grad]
        if precision == "fp32":
            for p in self.trained:
                p.grad = torch.zeros_like(p)
            self.optimizer = torch.optim.AdamW(groups or self.trained, lr=lr, weight_decay=weight_decay)

    def set_lr(self, lr):
        """lr: one value for every param group, or a list of one per group."""
        lrs = list(lr) if isinstance(lr, (list, tuple)) else [lr] * len(self.optimizer.param_groups)
        for group, value in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = value

    def step(self, batch):
        """One optimizer step on `batch`; returns its loss."""
        if self.precision == "fp32":
            self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss(self.model, batch)
        if self.loss_scale is None:
            loss.backward()
        else:
            (loss.float() * self.loss_scale).backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.trained, self.clip)
        if self.precision != "fp32":
            for master, p in zip(self.masters, self.trained):
                master.grad = p.grad.float() if self.loss_scale is None else p.grad.float() / self.loss_scale
                p.grad = None
        self.optimizer.step()
        if self.precision != "fp32":
            with torch.no_grad():
                for master, p in zip(self.masters, self.trained):
                    p.copy_(master)
        return loss.item()


def adamw_reference(steps, batch, lr=LR, clip=0.0, two_groups=False, precision="fp32", device="cpu",
                    loss_scale=None):
    """AdamWReference on make_model() over global_batch(0 .. steps - 1, batch): what every
    engine configuration of the tiny transformer is held to. Returns the losses and the final
    state dict."""
    model = make_model().to(device)
    reference = AdamWReference(model, lr=lr, clip=clip, groups=no_decay_groups(model) if two_groups else None,
                               precision=precision, loss_scale=loss_scale)
    losses = [reference.step(global_batch(step, batch).to(device)) for step in range(steps)]
    return losses, model.state_dict()


def assert_like_adamw(result, ref_losses, ref_state, precision, what, rtol=1e-4, atol=1e-5):
    """result ({"losses", "state"}) against adamw_reference's: fp32 to rtol / atol, bf16 and fp16
    within bf16's tolerance (the fp32-master recipe: test_mixed_precision's check)."""
    import pytest
    import torch

    from test_mixed_precision import _assert_bf16_close

    if precision == "fp32":
        assert result["losses"] == pytest.approx(ref_losses, rel=rtol), what
        for name, ref in ref_state.items():
            torch.testing.assert_close(result["state"][name], ref, rtol=rtol, atol=atol, msg=f"{what} {name}")
    else:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-2), what
        for name, ref in ref_state.items():
            _assert_bf16_close(result["state"][name], ref, f"{what}, {name}")
