#include "zeroshard/stage3/unit_builder.h"

#include <c10/util/Exception.h>

#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace zeroshard {

std::vector<UnitSpec> assignUnits(const std::vector<std::pair<std::string, at::Tensor>>& namedParams,
                                  const std::vector<std::string>& unitNames,
                                  const std::vector<std::vector<at::Tensor>>& unitParams) {
  TORCH_CHECK(unitNames.size() == unitParams.size(), "zeroshard stage 3: ", unitNames.size(), " unit names but ",
              unitParams.size(), " parameter lists");
  std::unordered_map<const void*, std::unordered_set<size_t>> owners;
  for (size_t u = 0; u < unitParams.size(); ++u) {
    for (const auto& p : unitParams[u]) owners[p.unsafeGetTensorImpl()].insert(u);
  }
  std::vector<UnitSpec> specs;
  for (const auto& name : unitNames) specs.push_back(UnitSpec{name, {}, false});
  specs.push_back(UnitSpec{"<root>", {}, true});
  for (const auto& [name, p] : namedParams) {
    if (!p.requires_grad()) continue;
    auto it = owners.find(p.unsafeGetTensorImpl());
    const bool single = it != owners.end() && it->second.size() == 1;
    specs[single ? *it->second.begin() : unitNames.size()].paramNames.push_back(name);
  }
  return specs;
}

Stage3Units buildStage3Units(const std::vector<ParamGroupSpec>& groups, std::vector<UnitSpec> specs,
                             const UnitOptions& options, int rank, int worldSize, at::ScalarType computeDtype,
                             std::optional<at::Device> metaDevice) {
  Stage3Units out;
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
  if (specs.empty()) specs.push_back(UnitSpec{"root", allNames, true});

  const int64_t persistence = options.persistenceThreshold;
  std::unordered_set<std::string> placed;
  std::vector<at::Tensor> keptParams;
  std::vector<std::string> keptNames;
  std::vector<int> keptGroups;
  for (const auto& spec : specs) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::vector<int> groupIds;
    UnitInfo& info = out.infos.emplace_back(UnitInfo{spec.name, 0, {}, {}, 0, spec.root});
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
      out.unitOf.emplace_back(std::nullopt);
      continue;
    }
    out.unitOf.emplace_back(UnitIndex{out.buckets.size()});
    out.buckets.emplace_back(std::move(params), std::move(names), std::move(groupIds), rank, worldSize, computeDtype,
                             metaDevice);
    out.policies.push_back(UnitPolicy{spec.root ? false : options.reshardAfterForward, false});
  }
  for (const auto& name : allNames) {
    TORCH_CHECK(placed.count(name), "zeroshard stage 3: trainable parameter '", name,
                "' is in no unit; pass it in the root unit");
  }
  if (!keptParams.empty()) {
    // Note [persistent parameters]: small parameters (biases, norms) cost more in latency than
    // they save in memory; they form one unit that stays gathered and is all-gathered once
    // after each optimizer step, like stage 2.
    out.buckets.emplace_back(std::move(keptParams), std::move(keptNames), std::move(keptGroups), rank, worldSize,
                             computeDtype, metaDevice);
    out.policies.push_back(UnitPolicy{false, true});
  }
  return out;
}

}  // namespace zeroshard
