"""The benchmark steps with torch.compile: config "<step>-compiled" is steps.make_step's <step>
with its transformer blocks compiled by inductor, each library the way its users compile it.

- zeroshard-stage<k>[-bf16]-compiled: the step's engine, then engine.compile(backend="inductor"):
  each Block's forward compiled in place, zeroshard's hooks outside the graphs (docs/compile.md).
- fsdp2[-bf16]-compiled: torchtitan's order (apply_compile before apply_fsdp): each block wrapped
  in torch.compile(block, fullgraph=True) and put back in model.blocks, then fully_shard on those
  wrappers and the root, so FSDP2's hooks sit on the wrapper, outside the graphs, as zeroshard's do.
- ddp-compiled: each block compiled the same way before DDP wraps the model (DDP's gradient
  hooks are on the parameters, outside the graphs), so every compiled config compiles the same
  modules; the rest runs eagerly, as below.

Everything else (embeddings, final norm, head, the loss, the optimizer step) runs eagerly in
every compiled config. The first step compiles (the forward and the backward AOTAutograd derives
from it): a benchmark times compiled steps after a warm-up of at least one step, and counts
dynamo's graphs (graphs_compiled) to show that no timed step compiled.
"""

import torch

from steps import DDPStep, FSDP2Step, ZeroshardStep

COMPILED = "-compiled"
BACKEND = "inductor"


def compiled_step(base, model, recipe):
    """The step of config `base` (a steps.make_step name) with its blocks compiled."""
    from steps import make_step

    if base.startswith("fsdp2") or base == "ddp":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=BACKEND, fullgraph=True)
        step = make_step(base, model, recipe)
        assert isinstance(step, (FSDP2Step, DDPStep)), base
        wrapper = "fully_shard" if isinstance(step, FSDP2Step) else "DDP"
        step.optimizer_name += f"; blocks torch.compile'd ({BACKEND}) before {wrapper}"
        return step
    step = make_step(base, model, recipe)
    if not isinstance(step, ZeroshardStep):
        raise ValueError(f"no compiled variant of {base!r}: compile zeroshard-stage<k>, ddp or fsdp2 configs")
    step.engine.compile(backend=BACKEND)
    step.optimizer_name += f"; engine.compile(backend={BACKEND!r})"
    return step


def graphs_compiled():
    """Graphs dynamo has compiled in this process so far (its unique_graphs counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
