"""A Hugging Face config.json as the planner's ModelParams: the parameters (names, sizes and
order), stage-3 units and Linear layers that transformers would build for it, counted without
building it.

Two families, chosen by model_type:
- "gpt2": GPT2LMHeadModel. Per layer 12h² + 13h (ln_1, c_attn 3h² + 3h, c_proj h² + h, ln_2,
  c_fc h·i + i, c_proj i·h + h with i = n_inner or 4h), plus V·h token and P·h position
  embeddings and ln_f (2h); the head is tied to the token embedding.
- everything else: Llama-style (LlamaForCausalLM; Mistral and Qwen2 share its shapes). With d
  the head size (head_dim, else h/a) and kv the key-value heads (num_key_value_heads, else a):
  per layer q h·a·d, k and v h·kv·d each, o a·d·h, gate/up/down 3·h·i, two RMSNorm weights 2h;
  attention_bias adds a·d + 2·kv·d + h (Qwen2: q/k/v biases only), mlp_bias 2i + h; plus the
  V·h embedding, the final norm h and, unless tie_word_embeddings, the V·h head.
tests/python/test_planner.py holds both to transformers' own models built on the meta device.
"""

import json
from dataclasses import dataclass

from zeroshard.planner.model_params import ROOT, Linear, ModelParams


class ConfigKeyError(ValueError):
    """A config.json without a key the count needs (the message names the key and the file)."""


@dataclass(frozen=True)
class TransformerShape:
    """What activations depend on: hidden size, layers, attention heads, vocabulary."""

    hidden: int
    layers: int
    heads: int
    vocab: int


# transformers' defaults for tie_word_embeddings, by model_type, when config.json leaves it out.
_TIED_BY_DEFAULT = {"gpt2": True, "llama": False, "mistral": False, "qwen2": False}


def read_config(path):
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise ConfigKeyError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigKeyError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigKeyError(f"{path} holds a JSON {type(config).__name__}, not a config object")
    return config


def _get(config, key, source, default=None, required=True):
    value = config.get(key, default)
    if value is None and required:
        raise ConfigKeyError(f"{source} has no '{key}', which the parameter count needs "
                             f"(model_type {config.get('model_type', 'not given')!r})")
    return value


def _gpt2(config, source):
    h, layers = _get(config, "n_embd", source), _get(config, "n_layer", source)
    vocab, positions = _get(config, "vocab_size", source), _get(config, "n_positions", source)
    heads = _get(config, "n_head", source)
    inner = config.get("n_inner") or 4 * h
    params = [("transformer.wte.weight", vocab * h), ("transformer.wpe.weight", positions * h)]
    units, linears = [], []
    for i in range(layers):
        p = f"transformer.h.{i}."
        linears += [Linear(p + "attn.c_attn", h, 3 * h), Linear(p + "attn.c_proj", h, h),
                    Linear(p + "mlp.c_fc", h, inner), Linear(p + "mlp.c_proj", inner, h)]
        layer = [(p + "ln_1.weight", h), (p + "ln_1.bias", h), (p + "attn.c_attn.weight", 3 * h * h),
                 (p + "attn.c_attn.bias", 3 * h), (p + "attn.c_proj.weight", h * h), (p + "attn.c_proj.bias", h),
                 (p + "ln_2.weight", h), (p + "ln_2.bias", h), (p + "mlp.c_fc.weight", h * inner),
                 (p + "mlp.c_fc.bias", inner), (p + "mlp.c_proj.weight", inner * h), (p + "mlp.c_proj.bias", h)]
        params += layer
        units.append((f"transformer.h.{i}", tuple(n for n, _ in layer)))
    root = [("transformer.ln_f.weight", h), ("transformer.ln_f.bias", h)]
    if not config.get("tie_word_embeddings", True):
        root.append(("lm_head.weight", vocab * h))
    params += root
    units.append((ROOT, ("transformer.wte.weight", "transformer.wpe.weight") + tuple(n for n, _ in root)))
    linears.append(Linear("lm_head", h, vocab))  # a module even when its weight is the embedding's
    return params, units, linears, TransformerShape(h, layers, heads, vocab)


def _llama(config, source):
    h, layers = _get(config, "hidden_size", source), _get(config, "num_hidden_layers", source)
    heads, vocab = _get(config, "num_attention_heads", source), _get(config, "vocab_size", source)
    inner = _get(config, "intermediate_size", source)
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    qwen2 = config.get("model_type") == "qwen2"
    attention_bias = qwen2 or bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    params = [("model.embed_tokens.weight", vocab * h)]
    units, linears = [], []
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = []
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            linears.append(Linear(f"{p}self_attn.{name}", h, rows))
            layer.append((f"{p}self_attn.{name}.weight", rows * h))
            if attention_bias:
                layer.append((f"{p}self_attn.{name}.bias", rows))
        linears.append(Linear(f"{p}self_attn.o_proj", heads * d, h))
        layer.append((f"{p}self_attn.o_proj.weight", heads * d * h))
        if attention_bias and not qwen2:
            layer.append((f"{p}self_attn.o_proj.bias", h))
        for name, rows, columns in (("gate_proj", inner, h), ("up_proj", inner, h), ("down_proj", h, inner)):
            linears.append(Linear(f"{p}mlp.{name}", columns, rows))
            layer.append((f"{p}mlp.{name}.weight", h * inner))
            if mlp_bias:
                layer.append((f"{p}mlp.{name}.bias", rows))
        layer += [(p + "input_layernorm.weight", h), (p + "post_attention_layernorm.weight", h)]
        params += layer
        units.append((f"model.layers.{i}", tuple(n for n, _ in layer)))
    root = [("model.norm.weight", h)]
    if not _tied(config):
        root.append(("lm_head.weight", vocab * h))
    params += root
    units.append((ROOT, ("model.embed_tokens.weight",) + tuple(n for n, _ in root)))
    linears.append(Linear("lm_head", h, vocab))  # a module even when its weight is the embedding's
    return params, units, linears, TransformerShape(h, layers, heads, vocab)


def _tied(config):
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return _TIED_BY_DEFAULT.get(config.get("model_type"), False)


def model_params(config, source="config.json"):
    """(ModelParams, TransformerShape, notes) of a config.json's dict; notes say what was
    assumed (a family by model_type, a default tie_word_embeddings)."""
    notes = []
    model_type = config.get("model_type")
    if model_type == "gpt2":
        params, units, linears, shape = _gpt2(config, source)
        family = "GPT-2"
    else:
        params, units, linears, shape = _llama(config, source)
        family = "Llama-style"
        if model_type not in _TIED_BY_DEFAULT:
            notes.append(f"model_type {model_type!r} counted as a Llama-style model (gated MLP, no biases "
                         "unless attention_bias / mlp_bias)")
    if "tie_word_embeddings" not in config:
        notes.append(f"tie_word_embeddings not in {source}: {str(_tied(config)).lower()}, "
                     f"transformers' default for {model_type or 'this model'}")
    notes.insert(0, f"{family} model from {source}")
    return ModelParams(tuple(params), tuple(units), linears=tuple(linears)), shape, notes
