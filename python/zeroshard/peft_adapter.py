"""save_16bit_model for a peft model: its adapter, as peft saves it (issue 30).

With exclude_frozen_parameters=True, an engine whose module is a peft PeftModel writes the trained
adapter under peft's own names (get_peft_model_state_dict's: the adapter name left out of each
key, "base_model.model." kept), by default as save_dir/adapter_model.safetensors, and rank 0 writes
adapter_config.json beside it: PeftModel.from_pretrained(base_model, save_dir) loads the result,
and so does set_peft_model_state_dict(model, load_file(path)).

Note [peft names as aliases]: the file is written by the engine's own streamed export
(save16bitModel: crash-safe, every rank agreeing on the outcome, one stage-3 unit gathered at a
time, trained parameters in the compute dtype). That export writes the entries of the module
state the engine holds, and an entry whose tensor is a trained parameter under another name is
an alias written under that entry's name. For the call, the module state is peft's adapter state
dict, whose values are the model's own Parameters: the export writes exactly peft's keys. The
module's own state is put back afterwards.

peft is not imported here unless the module is a PeftModel (which needs peft imported already).
"""

import copy
import os
import sys
import tempfile

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"         # peft's CONFIG_NAME


def is_peft_model(module):
    """Whether module is a peft PeftModel (without importing peft: a PeftModel needs it loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def save_adapter(engine, save_dir, save_filename=None):
    """Engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters=True) for a
    PeftModel: its active adapter's trained entries under peft's names into save_dir/save_filename
    (default adapter_model.safetensors; a name not ending in .safetensors writes torch.save's
    format, as peft's adapter_model.bin), then, from rank 0, adapter_config.json. Every rank calls
    it. Returns what the export returned (False: stage 3 without
    stage3_gather_16bit_weights_on_model_save, nothing written)."""
    model = engine.module
    adapter = _active_adapter(model)
    entries = _trained_entries(model, adapter)
    engine._core.set_module_state_from(entries)  # Note [peft names as aliases]
    try:
        from zeroshard import _C

        saved = _C._save_16bit_model(engine._core, save_dir, save_filename or ADAPTER_WEIGHTS, [])["saved"]
    finally:
        engine._refresh_module_state()
    if saved and engine._core.rank == 0:
        write_adapter_config(model, adapter, save_dir)
    return saved


def _active_adapter(model):
    adapter = model.active_adapter
    if not isinstance(adapter, str):
        raise ValueError(f"zeroshard save_16bit_model: the peft model has several active adapters ({adapter}); "
                         "exclude_frozen_parameters=True writes one adapter: call model.set_adapter(name) first")
    return adapter


def _trained_entries(model, adapter):
    """peft's state dict of `adapter` over the model's own tensors (no value is read), less the
    frozen parameters: [(peft's key, Parameter or buffer)]. Embedding layers are peft's entries
    only where they are trained (modules_to_save): save_embedding_layers would add frozen base
    weights, which exclude_frozen_parameters leaves out, and its "auto" asks the Hub."""
    import torch
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True), adapter_name=adapter,
                                      save_embedding_layers=False)
    entries = [(k, v) for k, v in state.items() if not (isinstance(v, torch.nn.Parameter) and not v.requires_grad)]
    if not any(isinstance(v, torch.nn.Parameter) for _, v in entries):
        raise ValueError(f"zeroshard save_16bit_model: the peft model's adapter '{adapter}' has no trained "
                         "parameter to save (every one of its parameters has requires_grad=False); pass "
                         "exclude_frozen_parameters=False to save the whole model")
    return entries


def write_adapter_config(model, adapter, save_dir):
    """save_dir/adapter_config.json as PeftModel.save_pretrained writes it (inference_mode on, the
    base model's name_or_path, the auto mapping of a config without task_type), written beside
    and renamed into place, so that a crash leaves the old file or the new one."""
    config = copy.deepcopy(model.peft_config[adapter])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path") or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        base_class = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    with tempfile.TemporaryDirectory(dir=save_dir, prefix=f".{ADAPTER_CONFIG}.") as staging:
        config.save_pretrained(staging, auto_mapping_dict=auto_mapping)
        written = os.path.join(staging, ADAPTER_CONFIG)
        with open(written, "rb") as f:
            os.fsync(f.fileno())
        os.replace(written, os.path.join(save_dir, ADAPTER_CONFIG))
