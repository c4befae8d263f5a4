"""What test_compile.py checks, run on every rank: the same model trained eagerly and with
engine.compile() (inductor on CPU) from the same start and batches."""

import torch

from models import global_batch, make_model

STEPS, MICRO = 5, 2


def _config(stage, dtype="fp32", offload=False, compile_section=None):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zeroshard": {"collective_timeout_seconds": 120}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if compile_section is not None:
        config["compile"] = compile_section
    return config


def _train(rank, world, stage, compiled, **config):
    import zeroshard
    from torch._dynamo.utils import counters

    model = make_model()
    engine = zeroshard.initialize(model, _config(stage, **config))
    if compiled:
        torch._dynamo.reset()  # each stage compiles its own graphs, counted from zero
        counters.clear()
    names = engine.compile(backend="inductor") if compiled else []
    losses, graphs = [], []
    for step in range(STEPS):
        tokens = global_batch(step, MICRO * world)[rank * MICRO:(rank + 1) * MICRO]
        loss = model.loss(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    # Stage 3: outside forward and backward every unit's parameters are released (their storage
    # holds no bytes), compiled or not.
    released = [p.untyped_storage().nbytes() == 0 for name, p in model.named_parameters()
                if name.startswith("blocks.")]
    return dict(losses=losses, graphs=graphs, names=names, released=released,
                memory=engine.memory_stats(), comm=engine.comm_stats())


def compiled_and_eager(rank, world, stage, dtype="fp32", offload=False):
    eager = _train(rank, world, stage, compiled=False, dtype=dtype, offload=offload)
    compiled = _train(rank, world, stage, compiled=True, dtype=dtype, offload=offload)
    return dict(eager=eager, compiled=compiled)


BACKEND = "zeroshard_test_counting"
_GRAPHS = []  # one entry per graph the counting backend compiled


def _counting_backend(gm, example_inputs):
    _GRAPHS.append(len(gm.graph.nodes))
    return gm.forward  # runs the captured graph as it is


def config_section(rank, world):
    """The config's "compile" section at stage 3: enabled compiles at initialize with its backend
    and kwargs; without enabled, backend and kwargs are engine.compile()'s defaults."""
    import zeroshard
    from zeroshard.compiled import is_compiled
    from torch._dynamo import list_backends, register_backend

    if BACKEND not in list_backends(exclude_tags=()):
        register_backend(_counting_backend, name=BACKEND)
    sections = {"enabled": {"enabled": True, "backend": BACKEND},
                "disabled by kwargs": {"enabled": True, "backend": BACKEND, "kwargs": {"disable": True}},
                "defaults of compile()": {"backend": BACKEND},
                "off": {"enabled": False, "backend": BACKEND}}
    out = {}
    for label, section in sections.items():
        torch._dynamo.reset()
        _GRAPHS.clear()
        model = make_model()
        engine = zeroshard.initialize(model, _config(3, compile_section=section))
        compiled_at_initialize = sorted(n for n, m in model.named_modules() if is_compiled(m))
        names = engine.compile() if label == "defaults of compile()" else []
        losses = []
        for step in range(2):
            tokens = global_batch(step, MICRO * world)[rank * MICRO:(rank + 1) * MICRO]
            loss = model.loss(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[label] = dict(at_initialize=compiled_at_initialize, names=names, graphs=len(_GRAPHS), losses=losses)
    return out


def deepspeed_compile(rank, world):
    """zeroshard.deepspeed's engine.compile (DeepSpeed's signature) at stage 3: the same losses as
    the same DeepSpeed script run eagerly; DeepCompile's schedule is refused."""
    import zeroshard.deepspeed as deepspeed

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, config=_config(3))
        if compiled:
            try:
                engine.compile(schedule=[(0, "anything")])
                out["schedule_error"] = ""
            except NotImplementedError as e:
                out["schedule_error"] = str(e)
            engine.compile(backend="inductor", compile_kwargs={"dynamic": False})
        losses = []
        for step in range(STEPS):
            tokens = global_batch(step, MICRO * world)[rank * MICRO:(rank + 1) * MICRO]
            loss = engine.module.loss(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["compiled" if compiled else "eager"] = losses
        out["is_compiled" if compiled else "eager_is_compiled"] = engine.is_compiled
    return out
