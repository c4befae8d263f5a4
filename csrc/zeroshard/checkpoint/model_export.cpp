#include "zeroshard/checkpoint/model_export.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace zeroshard {
namespace {

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct TrainedPlace {
  size_t bucket;
  size_t param;
};

} // namespace

ModelFileFormat modelFileFormatOf(const std::string& filename) {
  TORCH_CHECK(!filename.empty() && filename != "." && filename != ".." && filename.find('/') == std::string::npos,
              "zeroshard save_16bit_model: save_filename '", filename,
              "' must be a file name without '/' (the directory is save_dir), e.g. 'model.safetensors' or "
              "'pytorch_model.bin'");
  return endsWith(filename, ".safetensors") ? ModelFileFormat::kSafetensors : ModelFileFormat::kTorch;
}

ModelExportPlan planModelExport(const std::vector<Bucket>& buckets, const ModuleState& moduleState,
                                at::ScalarType computeDtype, bool byUnit, const ModelExportOptions& options,
                                const std::vector<Bucket>& frozenBuckets,
                                const std::function<int64_t(const ExportSource&)>& unitOf) {
  std::unordered_map<std::string, TrainedPlace> trained;
  std::vector<std::string> trainedOrder;
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t i = 0; i < buckets[b].size(); ++i) {
      trained.emplace(buckets[b].layout().params()[i].name, TrainedPlace{b, i});
      trainedOrder.push_back(buckets[b].layout().params()[i].name);
    }
  }
  std::unordered_map<std::string, std::string> aliasOf(moduleState.aliases.begin(), moduleState.aliases.end());
  std::unordered_map<std::string, size_t> moduleIndex;
  for (size_t j = 0; j < moduleState.tensors.size(); ++j) moduleIndex.emplace(moduleState.tensors[j].first, j);
  std::unordered_map<std::string, const ModuleState::Sharded*> shardedIndex;
  for (const auto& entry : moduleState.sharded) shardedIndex.emplace(entry.name, &entry);
  const std::vector<std::string>& keys = moduleState.keys.empty() ? trainedOrder : moduleState.keys;

  std::unordered_set<std::string> excluded;
  for (const auto& name : options.exclude) {
    TORCH_CHECK(std::find(keys.begin(), keys.end(), name) != keys.end(), "zeroshard ", options.operation,
                ": cannot exclude '", name, "': the model's state dict has no such entry");
    excluded.insert(name);
  }

  // In state-dict order first: each distinct tensor at its first name (Note [one tensor, several names]).
  ModelExportPlan plan;
  std::unordered_map<std::string, size_t> ofTrained;   // trained name -> tensor
  std::unordered_map<const void*, size_t> ofModule;    // module tensor's impl -> tensor
  for (const auto& key : keys) {
    if (excluded.count(key)) continue;
    const auto alias = aliasOf.find(key);
    const std::string& target = alias != aliasOf.end() ? alias->second : key;
    size_t index = plan.tensors.size();
    if (const auto t = trained.find(target); t != trained.end()) {
      const auto [it, isNew] = ofTrained.emplace(target, index);
      if (isNew) {
        plan.tensors.push_back({key, computeDtype, buckets[t->second.bucket].layout().params()[t->second.param].shape});
        plan.sources.push_back({t->second.bucket, t->second.param, 0, std::nullopt});
      }
      index = it->second;
    } else if (const auto f = shardedIndex.find(key); f != shardedIndex.end()) {
      const Bucket& bucket = frozenBuckets.at(f->second->bucket);
      const at::Tensor& param = bucket.params()[f->second->param];
      const auto [it, isNew] = ofModule.emplace(param.unsafeGetTensorImpl(), index);
      if (isNew) {
        plan.tensors.push_back({key, bucket.flatParams().scalar_type(), bucket.layout().params()[f->second->param].shape});
        plan.sources.push_back({std::nullopt, f->second->param, 0, f->second->bucket});
      }
      index = it->second;
    } else {
      const auto m = moduleIndex.find(key);
      TORCH_CHECK(m != moduleIndex.end(), "zeroshard ", options.operation, ": state-dict name '", key,
                  "' is neither a trained parameter nor module state");
      const at::Tensor& tensor = moduleState.tensors[m->second].second;
      const auto [it, isNew] = ofModule.emplace(tensor.unsafeGetTensorImpl(), index);
      if (isNew) {
        plan.tensors.push_back({key, tensor.scalar_type(), tensor.sizes().vec()});
        plan.sources.push_back({std::nullopt, 0, m->second, std::nullopt});
      }
      index = it->second;
    }
    plan.stateDict.emplace_back(key, index);
  }
  if (!byUnit) return plan;

  // Stage 3: bucket by bucket (each gathered once), module state (always whole) first.
  std::vector<size_t> order(plan.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  const auto group = [&](size_t i) {
    if (unitOf) return unitOf(plan.sources[i]);
    return plan.sources[i].bucket ? static_cast<int64_t>(*plan.sources[i].bucket) : int64_t{-1};
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return group(a) < group(b); });
  std::vector<size_t> position(order.size());
  ModelExportPlan sorted;
  for (size_t i = 0; i < order.size(); ++i) {
    position[order[i]] = i;
    sorted.tensors.push_back(plan.tensors[order[i]]);
    sorted.sources.push_back(plan.sources[order[i]]);
  }
  for (const auto& [key, index] : plan.stateDict) sorted.stateDict.emplace_back(key, position[index]);
  return sorted;
}

ModelFileWriter::ModelFileWriter(const std::string& path, ModelFileFormat format, const ModelExportPlan& plan)
    : path_(path) {
  if (format == ModelFileFormat::kSafetensors) {
    safetensors_.emplace(path, plan.tensors, std::map<std::string, std::string>{{"format", "pt"}});
  } else {
    torch_.emplace(path, plan.tensors, plan.stateDict);
  }
}

void ModelFileWriter::write(const at::Tensor& tensor) {
  if (safetensors_) {
    safetensors_->write(tensor);
  } else {
    torch_->write(tensor);
  }
}

int64_t ModelFileWriter::finish() {
  return safetensors_ ? safetensors_->finish(path_).bytes : torch_->finish();
}

} // namespace zeroshard
