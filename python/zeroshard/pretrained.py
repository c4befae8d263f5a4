"""What Engine.load_pretrained returns, and the renames of file tensor names it passes on (the
loading itself is C++: Engine::loadPretrained)."""

import re
from typing import NamedTuple

from zeroshard import _C
from zeroshard.peft_adapter import is_peft_model


class PretrainedLoad(NamedTuple):
    """The tensors of a pretrained checkpoint that did not fit the model, named as torch's
    load_state_dict and transformers' loading info name them. With strict=True any of them is an
    error instead (and nothing is loaded).

    missing_keys: state-dict names of the model absent from the files (a tied weight only when
      none of its names is there), in state-dict order; they keep their values.
    unexpected_keys: tensors in the files that are no state-dict name of the model.
    mismatched_keys: (name, shape in the file, shape in the model) for names in both whose shapes
      differ; they are not loaded."""

    missing_keys: list
    unexpected_keys: list
    mismatched_keys: list


def tensor_renames(path, module, key_mapping=None):
    """The exact renames {file tensor name: state-dict name} that Engine::loadPretrained takes
    for the checkpoint at `path` (its tensor names read from the headers only).

    key_mapping {regex: replacement}: each pattern in turn is re.sub'ed into every name (as
    transformers 5 applies from_pretrained(key_mapping=...), one renaming after another).
    Without it, a transformers PreTrainedModel gets transformers' own conversion mapping (the
    renames its from_pretrained applies, e.g. GPT-NeoX's embed_out -> lm_head); other models
    none. Errors here (a bad pattern, a WeightConverter) are the same on every rank."""
    peft = is_peft_model(module)
    named = module.get_base_model() if peft else module  # the model whose names the file holds
    if key_mapping is None and not peft and not is_transformers_model(named):
        return {}
    try:
        names = _C.pretrained_tensor_names(path)
    except RuntimeError:
        # Unreadable here: the collective load reports it on every rank (Note [agreement])
        # instead of this rank raising alone while the others wait in it.
        return {}
    if key_mapping is not None:
        compiled = [(re.compile(pattern), replacement) for pattern, replacement in dict(key_mapping).items()]
        renames = {}
        for name in names:
            renamed = name
            for pattern, replacement in compiled:
                renamed = pattern.sub(replacement, renamed)
            if renamed != name:
                renames[name] = renamed
    elif is_transformers_model(named):
        renames = _transformers_renames(names, named)
    else:
        renames = {}
    return _peft_renames(names, renames, module) if peft else renames


def _peft_renames(names, renames, module):
    """A peft model's checkpoint is its base model's: each base name (after `renames`) becomes the
    name the peft model gives it (under base_model.model., a wrapped layer's weight under
    base_layer.)."""
    to_peft = {}
    for key in module.state_dict(keep_vars=True):
        base = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if base != key:
            to_peft[base] = key
    out = {}
    for name in names:
        base = renames.get(name, name)
        target = to_peft.get(base, base)
        if target != name:
            out[name] = target
    return out


def is_transformers_model(module):
    # transformers is imported only for a model whose class comes from it.
    if not hasattr(module, "config") or not any(c.__module__.split(".")[0] == "transformers"
                                                for c in type(module).__mro__):
        return False
    from transformers.modeling_utils import PreTrainedModel
    return isinstance(module, PreTrainedModel)


def _transformers_renames(names, module):
    """transformers' WeightRenaming transforms for `module`, applied as its loading applies them:
    every renaming in turn, each with its own semantics (pattern lists, capture groups, the
    scope_prefix of a sub-model's transforms, a GroupWeightRename's guard, which is why the
    names go in the order its loader sorts them). A WeightConverter (a tensor operation, e.g.
    merging per-expert weights) that matches a name is an error: zeroshard reads tensors as
    they are stored."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renames = {}
    for name in sorted(names, key=dot_natural_key):
        renamed = name
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        for converter in converters:
            _, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                raise ValueError(
                    f"load_pretrained: tensor '{name}' of the checkpoint needs transformers' {converter!r} "
                    f"for {type(module).__name__} (its pattern '{pattern}' matches), which changes tensors, "
                    "not only names; zeroshard reads tensors as they are stored: convert the checkpoint once "
                    "(from_pretrained, then safetensors.torch.save_file(model.state_dict(), ...)) and load that")
        if renamed != name:
            renames[name] = renamed
    return renames
