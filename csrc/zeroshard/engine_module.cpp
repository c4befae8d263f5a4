// The torch::nn::Module entry point of Engine, kept apart so that only this translation unit
// pays for the C++ frontend's headers.
#include "zeroshard/engine.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

namespace zeroshard {
namespace {

std::vector<ParamGroupSpec> trainableParams(torch::nn::Module& model) {
  ParamGroupSpec group;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;  // frozen parameters stay as they are
    group.names.push_back(item.key());
    group.params.push_back(item.value());
  }
  return {std::move(group)};
}

} // namespace

Engine::Engine(torch::nn::Module& model, c10::intrusive_ptr<c10d::ProcessGroup> processGroup, Config config)
    : Engine(trainableParams(model), std::move(processGroup), std::move(config)) {}

} // namespace zeroshard
