"""What Engine.load_pretrained returns (the loading itself is C++: Engine::loadPretrained)."""

from typing import NamedTuple


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
