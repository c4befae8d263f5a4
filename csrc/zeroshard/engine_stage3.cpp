// Engine at stage 3: cutting the model into units and the module hooks that drive them.
#include "zeroshard/engine.h"

#include <c10/util/Exception.h>

#include "zeroshard/grad/grad_reducer.h"

#include <unordered_map>
#include <unordered_set>

namespace zeroshard {

std::vector<UnitPolicy> Engine::buildUnits(const std::vector<ParamGroupSpec>& groups,
                                           const std::vector<UnitSpec>& units) {
  struct Entry {
    at::Tensor param;
    int group;
  };
  std::unordered_map<std::string, Entry> byName;
  std::vector<std::string> allNames;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      byName.emplace(groups[g].names[i], Entry{groups[g].params[i], static_cast<int>(g)});
      allNames.push_back(groups[g].names[i]);
    }
  }
  std::vector<UnitSpec> specs = units;
  if (specs.empty()) specs.push_back(UnitSpec{"root", allNames, true});

  const int64_t persistence = config_.zero.stage3ParamPersistenceThreshold;
  std::unordered_set<std::string> placed;
  std::vector<at::Tensor> keptParams;
  std::vector<std::string> keptNames;
  std::vector<int> keptGroups;
  std::vector<UnitPolicy> policies;
  for (const auto& spec : specs) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::vector<int> groupIds;
    UnitInfo& info = unitInfos_.emplace_back(UnitInfo{spec.name, 0, {}, {}, 0, spec.root});
    for (const auto& name : spec.paramNames) {
      auto it = byName.find(name);
      TORCH_CHECK(it != byName.end(), "zeroshard stage 3: unit '", spec.name, "' lists parameter '", name,
                  "', which is not a trainable parameter of any param group");
      TORCH_CHECK(placed.insert(name).second, "zeroshard stage 3: parameter '", name,
                  "' is listed by two units; a parameter shared between units belongs to the root unit");
      const bool persistent = it->second.param.numel() <= persistence;
      (persistent ? keptParams : params).push_back(it->second.param);
      (persistent ? keptNames : names).push_back(name);
      (persistent ? keptGroups : groupIds).push_back(it->second.group);
      (persistent ? info.persistent : info.params).push_back(name);
      (persistent ? info.persistentNumel : info.numel) += it->second.param.numel();
    }
    if (params.empty()) {
      specToUnit_.push_back(-1);
      continue;
    }
    specToUnit_.push_back(static_cast<int>(buckets_.size()));
    buckets_.emplace_back(std::move(params), std::move(names), std::move(groupIds), comm_.rank(),
                          comm_.worldSize(), computeDtype_);
    policies.push_back(UnitPolicy{spec.root ? false : config_.extras.reshardAfterForward, false});
  }
  for (const auto& name : allNames) {
    TORCH_CHECK(placed.count(name), "zeroshard stage 3: trainable parameter '", name,
                "' is in no unit; pass it in the root unit");
  }
  if (!keptParams.empty()) {
    // Note [persistent parameters]: small parameters (biases, norms) cost more in latency than
    // they save in memory; they form one unit that stays gathered and is all-gathered once
    // after each optimizer step, like stage 2.
    buckets_.emplace_back(std::move(keptParams), std::move(keptNames), std::move(keptGroups), comm_.rank(),
                          comm_.worldSize(), computeDtype_);
    policies.push_back(UnitPolicy{false, true});
  }
  return policies;
}

std::vector<std::string> Engine::unitNames() const {
  std::vector<std::string> names;
  for (const auto& info : unitInfos_) names.push_back(info.name);
  return names;
}

void Engine::preForward(size_t unitSpec) {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ", stage());
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
  if (specToUnit_[unitSpec] >= 0) units_->preForward(static_cast<size_t>(specToUnit_[unitSpec]));
}

void Engine::postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(units_, "zeroshard: unit hooks are for stage 3; this engine runs stage ", stage());
  TORCH_CHECK(unitSpec < specToUnit_.size(), "zeroshard: unit ", unitSpec, " does not exist (",
              specToUnit_.size(), " units)");
  if (specToUnit_[unitSpec] >= 0) units_->postForward(static_cast<size_t>(specToUnit_[unitSpec]), outputs);
}

at::Tensor Engine::runUnit(size_t unitSpec, const std::function<at::Tensor()>& forward) {
  if (!units_) return forward();
  preForward(unitSpec);
  at::Tensor out = forward();
  postForward(unitSpec, {out});
  return out;
}

void Engine::gatherParameters() {
  if (units_) units_->gatherAll();
}

void Engine::reshardParameters() {
  if (units_) units_->reshardAll();
}

} // namespace zeroshard
