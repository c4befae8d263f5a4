// Engine at stage 3: the module hooks that drive the stage-3 scheduler.
#include "zeroshard/engine/engine.h"

#include <c10/util/Exception.h>

namespace zeroshard {

std::vector<std::string> Engine::unitNames() const {
  std::vector<std::string> names;
  for (const auto& info : unitInfos_) names.push_back(info.name);
  return names;
}

void Engine::preForward(size_t unitSpec, const std::optional<std::vector<at::Tensor>>& inputs) {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ", stage());
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
  if (!specToUnit_[unitSpec]) return;
  if (inputs) units_->watchInputs(*specToUnit_[unitSpec], *inputs);
  units_->preForward(*specToUnit_[unitSpec]);
}

void Engine::postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ", stage());
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
  if (specToUnit_[unitSpec]) units_->postForward(*specToUnit_[unitSpec], outputs);
}

bool Engine::watchesInputs(size_t unitSpec) const {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ", stage());
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
  return specToUnit_[unitSpec] && units_->watchesInputs(*specToUnit_[unitSpec]);
}

at::Tensor Engine::runUnit(size_t unitSpec, const std::function<at::Tensor()>& forward) {
  if (!units_) return forward();
  preForward(unitSpec);
  at::Tensor out = forward();
  postForward(unitSpec, {out});
  return out;
}

at::Tensor Engine::runUnit(size_t unitSpec, const std::vector<at::Tensor>& inputs,
                           const std::function<at::Tensor()>& forward) {
  if (!units_) return forward();
  preForward(unitSpec, inputs);
  at::Tensor out = forward();
  postForward(unitSpec, {out});
  return out;
}

void Engine::gatherParameters() {
  params_->gatherAll();
}

void Engine::reshardParameters() {
  params_->reshardAll();
}

} // namespace zeroshard
