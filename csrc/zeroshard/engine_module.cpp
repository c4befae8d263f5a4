// The torch::nn::Module entry point of Engine, kept apart so that only this translation unit
// pays for the C++ frontend's headers.
#include "zeroshard/engine.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
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

} // namespace

Engine::Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config,
               const std::vector<std::string>& unitModules)
    : Engine(nameParamGroups(std::nullopt, uniqueParams(model)), std::move(processGroup), std::move(config),
             unitSpecs(model, unitModules)) {
  setModuleStateFrom(stateOf(model));
}

} // namespace zeroshard
