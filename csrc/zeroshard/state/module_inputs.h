// A torch::nn::Module as the engine's input (ModelInputs): its trained parameters as one group,
// its frozen ones, stage 3's units by submodule name, its state dict, and, for a model built on
// the meta device, one initialisation step per module. Kept apart so that only module_inputs.cpp
// pays for the C++ frontend's headers.
#pragma once

#include <c10/core/Device.h>

#include "zeroshard/state/model_state.h"

#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace zeroshard {

// Called for every submodule (and the model itself, name "") that holds parameters or buffers of
// its own, in named_modules() order; fills them in place.
using ModuleInit = std::function<void(const std::string& name, torch::nn::Module& module)>;

// Every trainable parameter of `model` (each once, under its first name) in one group; at stage
// 3 `unitModules` names the submodules that are units. Every rank takes rank 0's module state.
ModelInputs modelInputsOf(torch::nn::Module& model, const std::vector<std::string>& unitModules);
// The same for a model built with meta tensors: its meta buffers and frozen parameters are
// given zeroed storage on `device` now (in place), and `init` runs as one MetaInit step per
// module (its trained parameters whole fp32 tensors on `device` during the call).
ModelInputs modelInputsOf(torch::nn::Module& model, const std::vector<std::string>& unitModules,
                          const ModuleInit& init, at::Device device);

} // namespace zeroshard
