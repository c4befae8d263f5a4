"""Which parameters a run trains and which it freezes: LoRA adapters on a frozen base
(--lora-rank, --lora-targets), or a fraction of the parameters trained (--trainable-fraction).
Both take a ModelParams whose parameters are all trained and return the one the run holds.

The frozen parameters are counted in the run's compute dtype: a base is loaded in the dtype its
forward computes in (from_pretrained(torch_dtype=torch.bfloat16) for a bf16 run; fp32 for an
fp32 run), and the engine keeps a frozen parameter in the dtype the module holds it in.
"""

import math

from zeroshard.planner.model_params import ITEMSIZE, ROOT, FrozenParam, Linear, ModelParams

# peft's names: get_peft_model wraps the model (base_model.model.), a targeted layer keeps its
# Linear as base_layer and gains one adapter, "default", as two Linear layers.
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama models


def _leaf(module):
    return module.rpartition(".")[2]


def check_unfrozen(model, what):
    """Refuses a model that freezes parameters of its own: --lora-rank and --trainable-fraction
    decide what is frozen."""
    if model.frozen:
        raise ValueError(f"the model already freezes {len(model.frozen)} parameters (e.g. {model.frozen[0].name!r}): "
                         f"leave out {what} to plan it as it is")


def lora_targets(model, targets):
    """The Linear layers of `model` whose own name (the last part) is one of `targets`; a target
    that names none is an error naming the layers there are."""
    names = {_leaf(linear.module) for linear in model.linears}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"{', '.join(missing)} names no Linear layer of the model; its Linear layers are "
                         f"{', '.join(sorted(names)) or 'none'}")
    return {linear.module: linear for linear in model.linears if _leaf(linear.module) in targets}


def with_lora(model, rank, targets, dtype):
    """The model as get_peft_model(model, LoraConfig(r=rank, target_modules=targets)) holds it:
    every parameter of the base frozen (in `dtype`) under peft's name, and each targeted
    Linear(in, out) with a trained lora_A (rank x in) and lora_B (out x rank) after its own
    parameters, in the stage-3 unit of its weight."""
    check_unfrozen(model, "--lora-rank")
    assert rank >= 1, rank
    targeted = lora_targets(model, targets)

    def renamed(name):
        module, _, leaf = name.rpartition(".")
        return f"{PEFT_PREFIX}{module}.base_layer.{leaf}" if module in targeted else PEFT_PREFIX + name

    def adapters(module):
        linear = targeted[module]
        return [(f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight", rank * linear.in_features),
                (f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight", linear.out_features * rank)]

    def in_order(names):
        """The new names of `names`, each targeted layer's adapters after its last parameter."""
        out = []
        for i, name in enumerate(names):
            out.append(renamed(name))
            module = name.rpartition(".")[0]
            if module in targeted and (i + 1 == len(names) or names[i + 1].rpartition(".")[0] != module):
                out += [a for a, _ in adapters(module)]
        return out

    numel = {renamed(n): k for n, k in model.params}
    numel.update(a for module in targeted for a in adapters(module))
    names = in_order([n for n, _ in model.params])
    # A targeted layer whose weight is another's (tied) has no parameter of its own to follow.
    listed = set(names)
    orphans = [a for module in targeted for a, _ in adapters(module) if a not in listed]
    params = tuple((n, numel[n]) for n in names + orphans)
    units = tuple((unit, tuple(in_order(list(unit_names)) + orphans)) if unit == ROOT
                  else (PEFT_PREFIX + unit, tuple(in_order(list(unit_names)))) for unit, unit_names in model.units)
    adapter_names = {a for module in targeted for a, _ in adapters(module)}
    frozen = tuple(FrozenParam(n, dtype, ITEMSIZE[dtype]) for n, _ in params if n not in adapter_names)
    linears = []
    for linear in model.linears:
        if linear.module not in targeted:
            linears.append(Linear(PEFT_PREFIX + linear.module, linear.in_features, linear.out_features))
            continue
        base = PEFT_PREFIX + linear.module
        linears += [Linear(f"{base}.base_layer", linear.in_features, linear.out_features),
                    Linear(f"{base}.lora_A.{ADAPTER}", linear.in_features, rank),
                    Linear(f"{base}.lora_B.{ADAPTER}", rank, linear.out_features)]
    return ModelParams(params, units, frozen, tuple(linears))


def trained_count(numel, fraction):
    """Elements trained of `numel` with --trainable-fraction: fraction x numel, rounded up."""
    assert 0 < fraction <= 1, fraction
    return min(numel, math.ceil(fraction * numel))


def with_trainable_fraction(model, fraction, dtype):
    """The model with its last parameters (named_parameters order: the head, then the top
    layers) trained, the fewest whose elements reach `fraction` of all, and the others frozen
    in `dtype`: what freezing the bottom of a model does."""
    check_unfrozen(model, "--trainable-fraction")
    wanted, trained, kept = trained_count(model.numel, fraction), 0, set()
    for name, numel in reversed(model.params):
        if trained >= wanted:
            break
        trained += numel
        kept.add(name)
    frozen = tuple(FrozenParam(n, dtype, ITEMSIZE[dtype]) for n, _ in model.params if n not in kept)
    return ModelParams(model.params, model.units, frozen, model.linears)
