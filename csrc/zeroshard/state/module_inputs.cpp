#include "zeroshard/state/module_inputs.h"

#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>

#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

// Every parameter once, under its first name (a tied parameter appears under several).
std::vector<std::pair<std::string, at::Tensor>> uniqueParams(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

// The frozen parameters (requires_grad=False), each once under its first name.
std::vector<std::pair<std::string, at::Tensor>> frozenParams(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, p] : uniqueParams(model)) {
    if (!p.requires_grad()) out.emplace_back(name, p);
  }
  return out;
}

std::vector<UnitSpec> unitSpecs(torch::nn::Module& model, const std::vector<std::string>& unitModules) {
  if (unitModules.empty()) return {};
  const auto modules = model.named_modules("", /*include_self=*/false);
  std::vector<std::vector<at::Tensor>> unitParams;
  for (const auto& name : unitModules) {
    const auto* module = modules.find(name);
    TORCH_CHECK(module, "zeroshard stage 3: the model has no submodule '", name, "'");
    unitParams.push_back((*module)->parameters(/*recurse=*/true));
  }
  return assignUnits(uniqueParams(model), unitModules, unitParams);
}

// The C++ frontend's state order (what torch::save writes): parameters, then buffers.
std::vector<std::pair<std::string, at::Tensor>> stateOf(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

// Gives every meta buffer and frozen parameter zeroed storage on `device` (in place: the module
// keeps its tensors), and makes one step per module that holds parameters or buffers itself.
MetaInit moduleSteps(torch::nn::Module& model, const ModuleInit& init, at::Device device) {
  for (auto& item : model.named_buffers(/*recurse=*/true)) {
    at::Tensor t = item.value();
    if (t.is_meta()) setTensorData(t, at::zeros(t.sizes(), t.options().device(device)));
  }
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    at::Tensor t = item.value();
    if (t.is_meta() && !t.requires_grad()) setTensorData(t, at::zeros(t.sizes(), t.options().device(device)));
  }
  std::unordered_map<const void*, std::string> trained;
  for (const auto& [name, p] : uniqueParams(model)) {
    if (p.requires_grad()) trained.emplace(p.unsafeGetTensorImpl(), name);
  }
  MetaInit out{device, {}};
  auto add = [&](const std::string& name, torch::nn::Module& module) {
    const auto params = module.named_parameters(/*recurse=*/false);
    if (params.is_empty() && module.named_buffers(/*recurse=*/false).is_empty()) return;
    InitStep step{name.empty() ? "<model>" : name, {}, [&init, name, &module] { init(name, module); }};
    for (const auto& item : params) {
      const auto it = trained.find(item.value().unsafeGetTensorImpl());
      if (it != trained.end()) step.params.push_back(it->second);
    }
    out.steps.push_back(std::move(step));
  };
  add("", model);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
  return out;
}

} // namespace

ModelInputs modelInputsOf(torch::nn::Module& model, const std::vector<std::string>& unitModules) {
  return {nameParamGroups(std::nullopt, uniqueParams(model)), unitSpecs(model, unitModules), {}, frozenParams(model),
          stateOf(model), /*broadcastStateDict=*/true};
}

ModelInputs modelInputsOf(torch::nn::Module& model, const std::vector<std::string>& unitModules,
                          const ModuleInit& init, at::Device device) {
  MetaInit steps = moduleSteps(model, init, device);
  return {nameParamGroups(std::nullopt, uniqueParams(model)), unitSpecs(model, unitModules), std::move(steps),
          frozenParams(model), stateOf(model), /*broadcastStateDict=*/false};
}

} // namespace zeroshard
