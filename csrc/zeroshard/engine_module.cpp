// The torch::nn::Module entry point of Engine, kept apart so that only this translation unit
// pays for the C++ frontend's headers.
#include "zeroshard/engine.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

std::vector<ParamGroupSpec> trainableParams(torch::nn::Module& model) {
  ParamGroupSpec group;
  std::unordered_set<const void*> seen;  // a tied parameter appears under several names
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;  // frozen parameters stay as they are
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    group.names.push_back(item.key());
    group.params.push_back(item.value());
  }
  return {std::move(group)};
}

// A parameter belongs to the one named unit that holds it; the rest, and parameters that
// several units share, belong to the root unit (last).
std::vector<UnitSpec> unitSpecs(torch::nn::Module& model, const std::vector<std::string>& unitModules) {
  if (unitModules.empty()) return {};
  const auto modules = model.named_modules("", /*include_self=*/false);
  std::unordered_map<const void*, std::vector<size_t>> owners;
  for (size_t u = 0; u < unitModules.size(); ++u) {
    const auto* module = modules.find(unitModules[u]);
    TORCH_CHECK(module, "zeroshard stage 3: the model has no submodule '", unitModules[u], "'");
    for (const auto& p : (*module)->parameters(/*recurse=*/true)) owners[p.unsafeGetTensorImpl()].push_back(u);
  }
  std::vector<UnitSpec> specs;
  for (const auto& name : unitModules) specs.push_back(UnitSpec{name, {}, false});
  specs.push_back(UnitSpec{"<root>", {}, true});
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    auto it = owners.find(p.unsafeGetTensorImpl());
    const bool single = it != owners.end() && it->second.size() == 1;
    specs[single ? it->second.front() : unitModules.size()].paramNames.push_back(item.key());
  }
  return specs;
}

// Frozen parameters and buffers are saved whole; a second name of a trained parameter is an
// alias of its first.
ModuleState moduleStateOf(torch::nn::Module& model) {
  ModuleState state;
  std::unordered_map<const void*, std::string> firstName;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    auto [it, first] = firstName.emplace(p.unsafeGetTensorImpl(), item.key());
    if (!first && !p.requires_grad()) continue;  // a tied frozen parameter is saved once
    state.keys.push_back(item.key());
    if (!first) {
      state.aliases.emplace_back(item.key(), it->second);
    } else if (!p.requires_grad()) {
      state.tensors.emplace_back(item.key(), p);
    }
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    state.keys.push_back(item.key());
    state.tensors.emplace_back(item.key(), item.value());
  }
  return state;
}

} // namespace

Engine::Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
               const std::vector<std::string>& unitModules)
    : Engine(trainableParams(model), std::move(processGroup), std::move(config), unitSpecs(model, unitModules)) {
  setModuleState(moduleStateOf(model));
}

} // namespace zeroshard
