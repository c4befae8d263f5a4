"""What the LoRA tests (test_lora.py) run on the spawned ranks, and the single-process reference.

The model is a real peft LoRA (q_proj and v_proj, r=4, no dropout) on a tiny transformers
LlamaForCausalLM built from a LlamaConfig (nothing is downloaded), with its base in fp32 or in
bf16 (cast before get_peft_model, which keeps the adapters in fp32). The engine config has no
bf16: the trained adapters are fp32, the frozen base keeps its own dtype.
"""

import warnings

import torch

VOCAB, SEQ, GLOBAL = 96, 12, 8         # tokens per sequence, sequences per optimizer step
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.05, (0.8, 0.99), 1e-6
THRESHOLD = 40                         # stage3_param_persistence_threshold: the norms (32) stay gathered
STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def base_model(base_dtype, seed=0):
    """The tiny Llama, its values drawn from `seed`, cast to base_dtype ("fp32" or "bf16")."""
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations that peft calls
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(DTYPES[base_dtype])


def lora_model(base_dtype, seed=0):
    """The peft LoRA model on base_model(base_dtype, seed); its adapters drawn from seed + 1."""
    import peft

    base = base_model(base_dtype, seed)
    torch.manual_seed(seed + 1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def global_batch(step):
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def probe():
    """The batch whose logits the tests compare."""
    return global_batch(99)[:2]


def engine_config(world_size, stage):
    return {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world_size,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS),
                                                      "eps": EPS}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "zeroshard": {"collective_timeout_seconds": 30}}


def train(engine, rank, world_size, steps):
    micro = GLOBAL // world_size
    for step in steps:
        tokens = global_batch(step)[rank * micro:(rank + 1) * micro]
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        assert engine.step() is not False  # True, or None from the DeepSpeed layer's


def split_state(model, state):
    """(trained entries, frozen parameters) of a state dict, by state-dict name."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return ({k: v for k, v in state.items() if k in trained}, {k: v for k, v in state.items() if k in frozen})


def train_and_export(rank, world_size, out, stage, base_dtype):
    """Trains STEPS steps, then saves the adapter into `out`; returns what the tests hold to
    their properties: the adapters and the frozen parameters, gathered (every rank's own view),
    the logits on probe(), what save_16bit_model returned, memory_stats() and the units."""
    import zeroshard

    model = lora_model(base_dtype)
    engine = zeroshard.initialize(model, engine_config(world_size, stage))
    train(engine, rank, world_size, range(STEPS))
    adapters, frozen = split_state(model, engine.full_state_dict())
    with torch.no_grad():
        logits = engine(input_ids=probe()).logits.float()
    saved = engine.save_16bit_model(out, exclude_frozen_parameters=True)
    return {"adapters": adapters, "frozen": frozen, "logits": logits, "saved": saved,
            "memory": engine.memory_stats(), "units": [u["name"] for u in engine.stage3_units()]}


class Params4bit(torch.nn.Parameter):
    """Stands for bitsandbytes.nn.Params4bit (not installed): recognised by its class name."""


def with_quantized_weight(model, kind):
    """model with one more frozen parameter of packed uint8 codes, as a 4-bit base holds them."""
    codes = torch.arange(64, dtype=torch.uint8).reshape(8, 8)
    param = Params4bit(codes, requires_grad=False) if kind == "Params4bit" else torch.nn.Parameter(codes, False)
    model.get_base_model().model.layers[0].mlp.register_parameter("packed", param)
    return model


def quantized_at_stage3(rank, world_size):
    """initialize's error at stage 3, for a Params4bit and for a plain uint8 frozen parameter."""
    import zeroshard

    errors = {}
    for kind in ("Params4bit", "uint8"):
        try:
            zeroshard.initialize(with_quantized_weight(lora_model("bf16"), kind), engine_config(world_size, 3))
            errors[kind] = None
        except ValueError as e:
            errors[kind] = str(e)
    return errors


def quantized_at_stage2(rank, world_size):
    """Stage 2 with a Params4bit frozen parameter: the adapters after two steps, the parameter
    after them."""
    import zeroshard

    model = with_quantized_weight(lora_model("fp32"), "Params4bit")
    engine = zeroshard.initialize(model, engine_config(world_size, 2))
    train(engine, rank, world_size, range(2))
    adapters, frozen = split_state(model, engine.full_state_dict())
    return {"adapters": adapters, "packed": frozen["base_model.model.model.layers.0.mlp.packed"],
            "class": type(model.get_base_model().model.layers[0].mlp.packed).__name__}


def deepspeed_exports(rank, world_size, out):
    """zeroshard.deepspeed's save_16bit_model on a peft model: the adapter (exclude_frozen_parameters)
    into out/adapter, the whole model (DeepSpeed's default file) into out/model."""
    import zeroshard.deepspeed as deepspeed

    model = lora_model("fp32")
    engine, *_ = deepspeed.initialize(model=model, config=engine_config(world_size, 3))
    train(engine, rank, world_size, range(1))
    return (engine.save_16bit_model(f"{out}/adapter", exclude_frozen_parameters=True),
            engine.save_16bit_model(f"{out}/model"))


# Note [the frozen base across a checkpoint]: the run that loads builds its base from another
# seed than the run that saved. A checkpoint saved with exclude_frozen_parameters=True holds no
# frozen parameter, so the loading run keeps its own base, bitwise, and continues training the
# saved adapters (with their optimizer state) over it.
CHECKPOINT_SAVE = {"world_size": 2, "stage": 3, "base": "bf16", "steps": 2}
CHECKPOINT_LOAD = {"world_size": 4, "stage": 2, "seed": 7}


def save_without_frozen(rank, world_size, ckpt):
    """Trains CHECKPOINT_SAVE's steps, saves a checkpoint without the
    frozen parameters; returns the adapters (fp32 masters) it saved."""
    import zeroshard

    model = lora_model(CHECKPOINT_SAVE["base"])
    engine = zeroshard.initialize(model, engine_config(world_size, CHECKPOINT_SAVE["stage"]))
    train(engine, rank, world_size, range(CHECKPOINT_SAVE["steps"]))
    engine.save_checkpoint(ckpt, tag="adapters", exclude_frozen_parameters=True)
    return split_state(model, engine.full_state_dict(dtype=torch.float32))[0]


def load_over_another_base(rank, world_size, ckpt):
    """Loads that checkpoint into a model whose base comes from another
    seed (Note [the frozen base across a checkpoint]); returns the adapters and the frozen
    parameters right after the load, and the adapters after one more step."""
    import zeroshard

    model = lora_model(CHECKPOINT_SAVE["base"], seed=CHECKPOINT_LOAD["seed"])
    engine = zeroshard.initialize(model, engine_config(world_size, CHECKPOINT_LOAD["stage"]))
    engine.load_checkpoint(ckpt, tag="adapters")
    loaded, frozen = split_state(model, engine.full_state_dict(dtype=torch.float32))
    train(engine, rank, world_size, [CHECKPOINT_SAVE["steps"]])
    return {"loaded": loaded, "frozen": frozen,
            "continued": split_state(model, engine.full_state_dict(dtype=torch.float32))[0]}


def adamw_reference(base_dtype, steps, base_seed_from=None):
    """Single-process torch.optim.AdamW over the adapters, on the whole global batch of each step
    (the same lr, betas, eps and weight decay): the adapters after each step, by state-dict name,
    and the model. base_seed_from (step, seed): from that step on, the frozen base is that seed's
    (a checkpoint loaded over another base)."""
    model = lora_model(base_dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)  # every adapter steps every step, as in the engine's flat buffers
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    after = []
    for step in steps:
        if base_seed_from is not None and step == base_seed_from[0]:
            other = lora_model(base_dtype, seed=base_seed_from[1])
            frozen = {n: p for n, p in other.named_parameters() if not p.requires_grad}
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in frozen:
                        p.copy_(frozen[n])
        optimizer.zero_grad(set_to_none=False)
        tokens = global_batch(step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    return after, model
