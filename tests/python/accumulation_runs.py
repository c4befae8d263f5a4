"""What test_accumulation_boundary.py runs on its ranks: accumulation windows ended by
set_gradient_accumulation_boundary, as the Hugging Face Trainer ends them (through accelerate:
the boundary set before every backward, True on a window's last micro-step, the loss divided
by the window's length and backpropagated with scale_wrt_gas=False)."""

import os

import torch

from models import global_batch, make_model
from training import engine_config

MICRO = 2
GAS = 4
WINDOWS = (4, 2, 4)  # the second ended early, as at the end of an epoch of 6 micro-batches


def config(stage, world_size, gas=GAS):
    cfg = engine_config(stage, micro=MICRO, gas=gas, zero={"stage3_param_persistence_threshold": 0})
    cfg["train_batch_size"] = MICRO * gas * world_size
    cfg["steps_per_print"] = 1
    return cfg


def window_micro_batches(window, length, rank, world_size):
    """Window `window`'s global batch global_batch(window, ...) over `length` micro-steps: rank r
    takes micro-batch i x world_size + r at micro-step i."""
    tokens = global_batch(window, MICRO * world_size * length)
    return [tokens[(i * world_size + rank) * MICRO:(i * world_size + rank + 1) * MICRO] for i in range(length)]


def run_window(engine, model, window, length, rank, world_size, record):
    """One window, the Trainer's way, on a zeroshard.Engine; appends (boundary after backward,
    step's result) per micro-step to `record`."""
    for i, tokens in enumerate(window_micro_batches(window, length, rank, world_size)):
        engine.set_gradient_accumulation_boundary(i == length - 1)
        loss = model.loss(tokens) / length
        engine.backward(loss, scale_wrt_gas=False)
        boundary = engine.is_gradient_accumulation_boundary
        record.append((boundary, engine.step()))


def forced_windows(rank, world_size, stage, directory):
    """zeroshard.Engine through windows of 4, 2 and 4; a checkpoint after the short one, resumed
    in a fresh engine that trains the last window alike."""
    import zeroshard

    model = make_model()
    engine = zeroshard.initialize(model, config(stage, world_size))
    lines = []
    engine._core.set_log_sink(lines.append)
    record, saved = [], None
    for window, length in enumerate(WINDOWS):
        run_window(engine, model, window, length, rank, world_size, record)
        if window == 1:
            saved = engine.save_checkpoint(directory)
    out = dict(record=record, lines=lines, saved=os.path.basename(saved), global_steps=engine.global_steps,
               micro_steps=engine.micro_steps, state=engine.full_state_dict())
    out["default tag"] = os.path.basename(engine.save_checkpoint(directory))

    resumed_model = make_model(seed=1)
    resumed = zeroshard.initialize(resumed_model, config(stage, world_size))
    path, _ = resumed.load_checkpoint(directory, tag=out["saved"])
    out["loaded"] = dict(path=os.path.basename(path), global_steps=resumed.global_steps,
                         micro_steps=resumed.micro_steps)
    run_window(resumed, resumed_model, 2, WINDOWS[2], rank, world_size, [])
    out["resumed state"] = resumed.full_state_dict()
    return out


def dropin_forced_windows(rank, world_size, stage, directory):
    """The same through zeroshard.deepspeed: DeepSpeed's counters follow the forced windows."""
    import zeroshard.deepspeed as deepspeed

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config(stage, world_size))
    record, before, global_steps = [], [], []
    for window, length in enumerate(WINDOWS):
        for i, tokens in enumerate(window_micro_batches(window, length, rank, world_size)):
            engine.set_gradient_accumulation_boundary(i == length - 1)
            before.append(engine.is_gradient_accumulation_boundary())
            loss = model.loss(tokens) / length
            returned = engine.backward(loss, scale_wrt_gas=False)
            record.append((engine.is_gradient_accumulation_boundary(), returned is loss))
            engine.step()
            global_steps.append(engine.global_steps)
    engine.save_checkpoint(directory)
    return dict(record=record, before=before, global_steps=global_steps, micro_steps=engine.micro_steps,
                samples=engine.global_samples, checkpoints=sorted(os.listdir(directory)),
                state=engine._engine.full_state_dict())


def dropin_false_at_the_boundary(rank, world_size):
    """A forced False at the natural boundary keeps accumulating; None counts again."""
    import zeroshard.deepspeed as deepspeed

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config(2, world_size, gas=2))
    start = {k: v.clone() for k, v in engine._engine.full_state_dict().items()}
    engine.set_gradient_accumulation_boundary(False)
    steps = []
    for tokens in window_micro_batches(0, 2, rank, world_size):  # the second is the natural boundary
        engine.backward(model.loss(tokens))
        engine.step()
        steps.append((engine.was_step_applied(), engine.global_steps))
    unchanged = all(torch.equal(v, start[k]) for k, v in engine._engine.full_state_dict().items())
    engine.set_gradient_accumulation_boundary(None)
    counted = engine.is_gradient_accumulation_boundary()
    engine.backward(model.loss(window_micro_batches(1, 1, rank, world_size)[0]))
    engine.step()
    steps.append((engine.was_step_applied(), engine.global_steps))
    return dict(steps=steps, unchanged=unchanged, counted=counted, micro_steps=engine.micro_steps)


def dropin_scale_wrt_gas(rank, world_size):
    """backward(loss / gas, scale_wrt_gas=False) against backward(loss), gas 4, 2 windows."""
    import zeroshard.deepspeed as deepspeed

    states = []
    for scale in (True, False):
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, config=config(2, world_size))
        for window in range(2):
            for tokens in window_micro_batches(window, GAS, rank, world_size):
                loss = model.loss(tokens)
                engine.backward(loss if scale else loss / GAS, scale_wrt_gas=scale)
                engine.step()
        states.append((engine.global_steps, engine._engine.full_state_dict()))
    return states


def dropin_accelerate_loop(rank, world_size, stage):
    """accelerate's DeepSpeedEngineWrapper.backward: boundary, backward, and step() only when the
    window ends; against the same windows with step() after every backward."""
    import zeroshard.deepspeed as deepspeed

    states = []
    for every_micro_step in (True, False):
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, world_size))
        for window, length in enumerate(WINDOWS):
            for i, tokens in enumerate(window_micro_batches(window, length, rank, world_size)):
                sync = i == length - 1
                engine.set_gradient_accumulation_boundary(sync)
                engine.backward(model.loss(tokens) / length, scale_wrt_gas=False)
                if sync or every_micro_step:
                    engine.step()
        states.append((engine.global_steps, engine._engine.full_state_dict()))
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(model.loss(window_micro_batches(3, 1, rank, world_size)[0]))
    try:
        engine.backward(model.loss(window_micro_batches(3, 1, rank, world_size)[0]))
        error = None
    except RuntimeError as e:
        error = str(e)
    return dict(states=states, error=error)
