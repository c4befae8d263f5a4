"""Models the planner knows by name (`--model llama-3-70b`): the keys of their Hugging Face
config.json that the parameter count reads (planner.hf_config), so that planning one needs no
download. Any other model: its own config.json, or --module."""

_LLAMA_3 = {"model_type": "llama", "vocab_size": 128256, "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}

KNOWN_MODELS = {
    # meta-llama/Meta-Llama-3-8B (Llama 3.1 8B has the same shapes)
    "llama-3-8b": {**_LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32},
    # meta-llama/Meta-Llama-3-70B (Llama 3.1 and 3.3 70B have the same shapes)
    "llama-3-70b": {**_LLAMA_3, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_hidden_layers": 80},
}


def known_model(name):
    """The config dict of a known model's name (any case), or None."""
    return KNOWN_MODELS.get(name.lower())
