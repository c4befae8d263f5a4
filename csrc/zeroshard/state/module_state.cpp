#include "zeroshard/state/module_state.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {

bool ModuleState::isFrozen(const std::string& name) const {
  return std::find(frozen.begin(), frozen.end(), name) != frozen.end();
}

ModuleState moduleStateOf(const std::vector<std::pair<std::string, at::Tensor>>& stateDict,
                          const std::vector<Bucket>& buckets, const std::vector<Bucket>& frozenBuckets,
                          const std::vector<std::pair<std::string, at::Tensor>>& frozenWhole) {
  std::unordered_map<const void*, const std::string*> trained;
  for (const auto& b : buckets) {
    for (size_t i = 0; i < b.size(); ++i) trained.emplace(b.params()[i].unsafeGetTensorImpl(), &b.layout().params()[i].name);
  }
  std::unordered_map<const void*, std::pair<size_t, size_t>> sharded;
  for (size_t b = 0; b < frozenBuckets.size(); ++b) {
    for (size_t i = 0; i < frozenBuckets[b].size(); ++i) {
      sharded.emplace(frozenBuckets[b].params()[i].unsafeGetTensorImpl(), std::make_pair(b, i));
    }
  }
  std::unordered_set<const void*> whole;
  for (const auto& [name, p] : frozenWhole) whole.insert(p.unsafeGetTensorImpl());
  ModuleState state;
  for (const auto& [key, tensor] : stateDict) {
    state.keys.push_back(key);
    const void* impl = tensor.defined() ? tensor.unsafeGetTensorImpl() : nullptr;
    auto it = impl ? trained.find(impl) : trained.end();
    if (it != trained.end()) {
      if (*it->second != key) state.aliases.emplace_back(key, *it->second);
      continue;
    }
    auto frozen = impl ? sharded.find(impl) : sharded.end();
    if (frozen != sharded.end()) {
      state.sharded.push_back({key, frozen->second.first, frozen->second.second});
      state.frozen.push_back(key);
      continue;
    }
    state.tensors.emplace_back(key, tensor);
    if (impl && whole.count(impl)) state.frozen.push_back(key);
  }
  return state;
}

void checkModuleState(const ModuleState& state, const std::vector<Bucket>& buckets) {
  std::unordered_set<std::string> trained;
  for (const auto& b : buckets) {
    for (const auto& p : b.layout().params()) trained.insert(p.name);
  }
  std::unordered_set<std::string> known(trained);
  for (const auto& [name, tensor] : state.tensors) {
    TORCH_CHECK(tensor.defined(), "zeroshard: module state '", name, "' is undefined");
    TORCH_CHECK(known.insert(name).second, "zeroshard: module state '", name,
                "' is also a trained parameter or appears twice");
  }
  for (const auto& entry : state.sharded) {
    TORCH_CHECK(known.insert(entry.name).second, "zeroshard: frozen parameter '", entry.name,
                "' is also a trained parameter or appears twice");
  }
  for (const auto& [alias, target] : state.aliases) {
    TORCH_CHECK(trained.count(target), "zeroshard: state-dict name '", alias, "' refers to '", target,
                "', which is not a trained parameter");
    TORCH_CHECK(known.insert(alias).second, "zeroshard: state-dict name '", alias, "' appears twice");
  }
  for (const auto& key : state.keys) {
    TORCH_CHECK(known.count(key), "zeroshard: state-dict name '", key,
                "' is neither a trained parameter, an alias nor a module-state tensor");
  }
}

} // namespace zeroshard
