#include "zeroshard/layout/param_groups.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {

std::vector<ParamGroupSpec> nameParamGroups(std::optional<std::vector<ParamGroupSpec>> given,
                                            const std::vector<std::pair<std::string, at::Tensor>>& modelParams) {
  std::unordered_map<const void*, const std::string*> names;
  for (const auto& [name, p] : modelParams) names.emplace(p.unsafeGetTensorImpl(), &name);
  std::vector<ParamGroupSpec> groups;
  if (given) {
    groups = std::move(*given);
  } else {
    ParamGroupSpec all;
    for (const auto& [name, p] : modelParams) {
      if (p.requires_grad()) all.params.push_back(p);
    }
    groups.push_back(std::move(all));
  }
  std::unordered_set<const void*> placed;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    group.names.clear();
    for (const auto& p : group.params) {
      auto it = p.defined() ? names.find(p.unsafeGetTensorImpl()) : names.end();
      TORCH_CHECK_VALUE(it != names.end(), "zeroshard.initialize: param group ", g, " holds a tensor of shape ",
                        p.defined() ? p.sizes() : c10::IntArrayRef{}, " that is not a parameter of the model");
      group.names.push_back(*it->second);
      placed.insert(p.unsafeGetTensorImpl());
    }
  }
  std::string missing;
  for (const auto& [name, p] : modelParams) {
    if (p.requires_grad() && !placed.count(p.unsafeGetTensorImpl())) missing += (missing.empty() ? "'" : ", '") + name + "'";
  }
  TORCH_CHECK_VALUE(missing.empty(), "zeroshard.initialize: trainable parameters [", missing,
                    "] are in no param group; add them to a group or set requires_grad=False");
  return groups;
}

void checkParamGroups(const std::vector<ParamGroupSpec>& groups) {
  std::unordered_set<const void*> seen;
  size_t trainable = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& group = groups[g];
    TORCH_CHECK(group.names.size() == group.params.size(), "zeroshard: param group ", g, " has ",
                group.params.size(), " parameters but ", group.names.size(), " names");
    for (size_t i = 0; i < group.params.size(); ++i) {
      const auto& p = group.params[i];
      const auto& name = group.names[i];
      TORCH_CHECK(p.defined(), "zeroshard: parameter '", name, "' is undefined");
      TORCH_CHECK(p.is_leaf() && p.requires_grad(), "zeroshard: parameter '", name,
                  "' must be a leaf tensor that requires grad (frozen parameters stay outside the engine)");
      TORCH_CHECK(p.scalar_type() == at::kFloat, "zeroshard: parameter '", name, "' is ", p.scalar_type(),
                  "; keep the model in float32 (bf16/fp16 compute comes from the config's bf16/fp16 keys)");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "zeroshard: parameter '", name,
                  "' appears twice (in two param groups, or under two names)");
      ++trainable;
    }
  }
  TORCH_CHECK(trainable > 0, "zeroshard: the model has no trainable parameters (none requires grad), "
                             "so there is nothing to shard or optimize");
}

bool paramsOnMeta(const std::vector<ParamGroupSpec>& groups) {
  std::optional<std::string> meta, real;
  std::string realDevice;
  for (const auto& g : groups) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].defined()) continue;
      if (g.params[i].is_meta()) {
        if (!meta) meta = g.names[i];
      } else if (!real) {
        real = g.names[i];
        realDevice = g.params[i].device().str();
      }
    }
  }
  TORCH_CHECK(!(meta && real), "zeroshard: parameter '", *meta, "' is on the meta device but '", *real, "' is on ",
              realDevice, "; build the whole model on the meta device, or none of it");
  return meta.has_value();
}

std::string deviceOfParamGroups(const std::vector<ParamGroupSpec>& groups) {
  for (const auto& group : groups) {
    for (const auto& p : group.params) {
      if (p.defined()) return p.device().str();
    }
  }
  return "cpu";
}

std::vector<Bucket> bucketParamGroups(const std::vector<ParamGroupSpec>& groups, int64_t capacity, int rank,
                                      int worldSize, at::ScalarType computeDtype,
                                      std::optional<at::Device> metaDevice) {
  std::vector<Bucket> buckets;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& group = groups[g];
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    int64_t filled = 0;
    auto flush = [&]() {
      if (params.empty()) return;
      std::reverse(params.begin(), params.end());
      std::reverse(names.begin(), names.end());
      std::vector<int> groupIds(params.size(), static_cast<int>(g));
      buckets.emplace_back(std::move(params), std::move(names), std::move(groupIds), rank, worldSize, computeDtype,
                           metaDevice);
      params.clear();
      names.clear();
      filled = 0;
    };
    for (size_t i = group.params.size(); i-- > 0;) {
      params.push_back(group.params[i]);
      names.push_back(group.names[i]);
      filled += group.params[i].numel();
      if (filled >= capacity) flush();
    }
    flush();
  }
  return buckets;
}

}  // namespace zeroshard
