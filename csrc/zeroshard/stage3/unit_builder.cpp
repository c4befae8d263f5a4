#include "zeroshard/stage3/unit_builder.h"

#include <c10/util/Exception.h>

#include <algorithm>
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
    auto it = owners.find(p.unsafeGetTensorImpl());
    const bool single = it != owners.end() && it->second.size() == 1;
    auto& spec = specs[single ? *it->second.begin() : unitNames.size()];
    (p.requires_grad() ? spec.paramNames : spec.frozenNames).push_back(name);
  }
  return specs;
}

namespace {

// Note [frozen parameters]: a frozen parameter (a LoRA base weight, a frozen embedding) is
// sharded with the unit it belongs to, as FSDP2 and DeepSpeed's ZeRO-3 do: it is needed whole
// for the unit's forward and for its backward (the input gradients), so it is gathered and
// released with the unit's trained parameters, but it has no gradient, no master copy and no
// optimizer state, and is never reduced. A unit's frozen parameters are laid out one flat
// buffer per dtype (a bf16 base beside fp32 norms), each padded and sharded like a trained
// unit's; the parameters become views of it and keep their dtype. Those at or under the
// persistence threshold stay whole on every rank, as persistent trained parameters stay gathered.
void addFrozenBuffers(Stage3Units& out, UnitBuffers& buffers, std::vector<at::Tensor> params,
                      std::vector<std::string> names, int rank, int worldSize,
                      std::optional<at::Device> metaDevice) {
  std::vector<at::ScalarType> dtypes;
  for (const auto& p : params) {
    if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) dtypes.push_back(p.scalar_type());
  }
  for (const auto dtype : dtypes) {
    std::vector<at::Tensor> ofDtype;
    std::vector<std::string> namesOfDtype;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].scalar_type() != dtype) continue;
      ofDtype.push_back(params[i]);
      namesOfDtype.push_back(names[i]);
    }
    const std::vector<int> noGroup(ofDtype.size(), -1);
    buffers.frozen.push_back(out.frozenBuckets.size());
    out.frozenBuckets.emplace_back(std::move(ofDtype), std::move(namesOfDtype), noGroup, rank, worldSize, dtype,
                                   metaDevice);
  }
}

}  // namespace

Stage3Units buildStage3Units(const std::vector<ParamGroupSpec>& groups, std::vector<UnitSpec> specs,
                             const UnitOptions& options, int rank, int worldSize, at::ScalarType computeDtype,
                             std::optional<at::Device> metaDevice,
                             const std::vector<std::pair<std::string, at::Tensor>>& frozen) {
  Stage3Units out;
  std::unordered_map<std::string, at::Tensor> frozenByName;
  for (const auto& [name, p] : frozen) {
    TORCH_CHECK(p.defined() && !p.requires_grad(), "zeroshard stage 3: frozen parameter '", name,
                "' is undefined or requires grad");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "zeroshard stage 3: frozen parameter '", name, "' is ",
                p.scalar_type(),
                "; stage 3 shards frozen weights as flat buffers of their own floating-point dtype, which a "
                "quantized or integer weight is not. Use stage 2 (frozen weights stay whole on every rank), or a "
                "bf16/fp16/fp32 base");
    frozenByName.emplace(name, p);
  }
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
  if (specs.empty()) specs.push_back(UnitSpec{"root", allNames, true, {}});
  {
    // Frozen parameters no spec lists belong to the root unit (the last root spec).
    std::unordered_set<std::string> listed;
    for (const auto& spec : specs) listed.insert(spec.frozenNames.begin(), spec.frozenNames.end());
    auto root = std::find_if(specs.rbegin(), specs.rend(), [](const UnitSpec& s) { return s.root; });
    TORCH_CHECK(frozen.empty() || root != specs.rend(), "zeroshard stage 3: no root unit to hold frozen parameters");
    for (const auto& [name, p] : frozen) {
      if (!listed.count(name)) root->frozenNames.push_back(name);
    }
  }

  const int64_t persistence = options.persistenceThreshold;
  std::unordered_set<std::string> placed;
  std::vector<at::Tensor> keptParams;
  std::vector<std::string> keptNames;
  std::vector<int> keptGroups;
  for (const auto& spec : specs) {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::vector<int> groupIds;
    UnitInfo& info = out.infos.emplace_back(UnitInfo{spec.name, 0, {}, {}, 0, spec.root, {}, 0});
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
    std::vector<at::Tensor> frozenParams;
    std::vector<std::string> frozenNames;
    for (const auto& name : spec.frozenNames) {
      auto it = frozenByName.find(name);
      TORCH_CHECK(it != frozenByName.end(), "zeroshard stage 3: unit '", spec.name, "' lists frozen parameter '", name,
                  "', which is not a frozen parameter of the model");
      TORCH_CHECK(placed.insert(name).second, "zeroshard stage 3: parameter '", name,
                  "' is listed by two units; a parameter shared between units belongs to the root unit");
      if (it->second.numel() <= persistence) {
        out.frozenWhole.emplace_back(name, it->second);
        continue;
      }
      frozenParams.push_back(it->second);
      frozenNames.push_back(name);
      info.frozen.push_back(name);
      info.frozenNumel += it->second.numel();
    }
    if (params.empty() && frozenParams.empty()) {
      out.unitOf.emplace_back(std::nullopt);
      continue;
    }
    out.unitOf.emplace_back(UnitIndex{out.buffers.size()});
    UnitBuffers buffers;
    if (!params.empty()) {
      buffers.trained = out.buckets.size();
      out.buckets.emplace_back(std::move(params), std::move(names), std::move(groupIds), rank, worldSize,
                               computeDtype, metaDevice);
    }
    addFrozenBuffers(out, buffers, std::move(frozenParams), std::move(frozenNames), rank, worldSize,
                     metaDevice);
    out.buffers.push_back(std::move(buffers));
    out.policies.push_back(UnitPolicy{spec.root ? false : options.reshardAfterForward, false});
  }
  for (const auto& [name, p] : frozen) {
    TORCH_CHECK(placed.count(name), "zeroshard stage 3: frozen parameter '", name,
                "' is in no unit; pass it in the root unit");
  }
  for (const auto& name : allNames) {
    TORCH_CHECK(placed.count(name), "zeroshard stage 3: trainable parameter '", name,
                "' is in no unit; pass it in the root unit");
  }
  if (!keptParams.empty()) {
    // Note [persistent parameters]: small parameters (biases, norms) cost more in latency than
    // they save in memory; they form one unit that stays gathered and is all-gathered once
    // after each optimizer step, like stage 2.
    out.buffers.push_back(UnitBuffers{out.buckets.size(), {}});
    out.buckets.emplace_back(std::move(keptParams), std::move(keptNames), std::move(keptGroups), rank, worldSize,
                             computeDtype, metaDevice);
    out.policies.push_back(UnitPolicy{false, true});
  }
  return out;
}

}  // namespace zeroshard
