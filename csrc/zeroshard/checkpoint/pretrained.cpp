#include "zeroshard/checkpoint/pretrained.h"

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include "zeroshard/config/json_input.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <unordered_set>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kAccepted =
    "load_pretrained takes a .safetensors file, a directory holding model.safetensors, or a Hugging Face "
    "sharded checkpoint (a directory holding model.safetensors.index.json and its shards, or that index file)";
// An index lists names and file names only; anything this large is not one.
constexpr std::uintmax_t kMaxIndexBytes = std::uintmax_t{256} << 20;

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string readSmallFile(const std::string& path) {
  std::error_code ec;
  const auto bytes = fs::file_size(path, ec);
  TORCH_CHECK(!ec, "zeroshard: cannot read '", path, "': ", ec.message());
  TORCH_CHECK(bytes <= kMaxIndexBytes, "zeroshard: '", path, "' is ", bytes, " bytes, too large for an index file");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "zeroshard: cannot open '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK(in.good() || in.eof(), "zeroshard: reading '", path, "' failed");
  return text.str();
}

} // namespace

PretrainedFiles::PretrainedFiles(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  const auto status = fs::status(path_, ec);
  TORCH_CHECK(fs::exists(status), "zeroshard: '", path_, "' does not exist; ", kAccepted);
  if (fs::is_directory(status)) {
    const fs::path dir(path_);
    if (fs::exists(dir / kSingleFile)) {
      add((dir / kSingleFile).string());
    } else if (fs::exists(dir / kIndexFile)) {
      openIndex((dir / kIndexFile).string());
    } else {
      const bool torchFile = fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json");
      TORCH_CHECK(false, "zeroshard: directory '", path_, "' holds neither ", kSingleFile, " nor ", kIndexFile,
                  torchFile ? " (its pytorch_model.bin is torch.save's format, which is not read: save the model "
                              "with save_pretrained(..., safe_serialization=True) or save_16bit_model)"
                            : "",
                  "; ", kAccepted);
    }
  } else if (endsWith(path_, ".index.json")) {
    openIndex(path_);
  } else {
    add(path_);
  }
}

void PretrainedFiles::openIndex(const std::string& indexPath) {
  nlohmann::json index;
  try {
    index = parseNestingBounded<nlohmann::json>(readSmallFile(indexPath));
  } catch (const std::exception& e) {  // nlohmann's, or JsonTooDeep
    TORCH_CHECK(false, "zeroshard: index '", indexPath, "' is not valid JSON: ", validUtf8(e.what()));
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
              "zeroshard: index '", indexPath, "' has no \"weight_map\" object (tensor name -> shard file)");
  const fs::path dir = fs::path(indexPath).parent_path();
  // The shards, in the order the map first names them; each opened (and its header checked) once.
  std::unordered_map<std::string, size_t> shardOf;
  std::vector<std::pair<std::string, std::string>> mapped;
  for (const auto& [name, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), "zeroshard: index '", indexPath, "' maps '", name, "' to ", shortText(file.dump(), 60),
                ", not a file name");
    const std::string shard = file.get<std::string>();
    mapped.emplace_back(name, shard);
    if (shardOf.count(shard)) continue;
    const fs::path shardPath = dir / shard;
    TORCH_CHECK(fs::is_regular_file(shardPath), "zeroshard: index '", indexPath, "' names shard file '", shard,
                "' (for '", name, "'), which is missing: '", shardPath.string(), "' does not exist");
    shardOf.emplace(shard, files_.size());
    add(shardPath.string());
  }
  for (const auto& [name, shard] : mapped) {
    const Located* found = find(name);
    TORCH_CHECK(found != nullptr && found->file == shardOf.at(shard), "zeroshard: index '", indexPath, "' maps '", name,
                "' to '", shard, "', which does not hold it",
                found != nullptr ? " (it is in '" + files_[found->file]->path() + "')" : std::string());
  }
}

void PretrainedFiles::add(const std::string& filePath) {
  const size_t index = files_.size();
  files_.push_back(std::make_unique<SafetensorsFile>(filePath));
  for (const auto& entry : files_.back()->header().entries) {
    const auto [it, added] = where_.emplace(entry.name, Located{index, &entry});
    TORCH_CHECK(added, "zeroshard: tensor '", entry.name, "' is in both '", files_[it->second.file]->path(),
                "' and '", filePath, "'");
    names_.push_back(entry.name);
  }
}

const PretrainedFiles::Located* PretrainedFiles::find(const std::string& name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? nullptr : &it->second;
}

PretrainedMatch matchPretrained(const PretrainedFiles& files, const std::vector<Bucket>& buckets,
                                const ModuleState& state, const TensorRenames& renames,
                                const std::vector<Bucket>& frozenBuckets) {
  PretrainedMatch match;
  auto modelName = [&](const std::string& fileName) -> const std::string& {
    const auto it = renames.find(fileName);
    return it == renames.end() ? fileName : it->second;
  };
  // The files' tensors under the model's names; on a collision the first in file order is kept.
  std::unordered_map<std::string, const PretrainedFiles::Located*> byModelName;
  for (const auto& name : files.names()) byModelName.emplace(modelName(name), files.find(name));
  auto find = [&](const std::string& name) -> const PretrainedFiles::Located* {
    const auto it = byModelName.find(name);
    return it == byModelName.end() ? nullptr : it->second;
  };
  std::unordered_set<std::string> known;
  // One piece of the model under all its names: the first present is read, every present one
  // must have the model's shape, and it is missing only when none is present.
  auto take = [&](const std::vector<std::string>& names, const std::vector<int64_t>& shape) {
    const PretrainedFiles::Located* taken = nullptr;
    bool mismatched = false;
    for (const auto& name : names) {
      known.insert(name);
      const auto* found = find(name);
      if (found == nullptr) continue;
      if (found->entry->shape != shape) {
        match.mismatched.push_back(
            {name, found->entry->shape, shape, found->entry->name != name ? found->entry->name : std::string()});
        mismatched = true;
      } else if (taken == nullptr) {
        taken = found;
      }
    }
    if (taken == nullptr && !mismatched) match.missing.push_back(names.front());
    return mismatched ? nullptr : taken;
  };

  std::unordered_map<std::string, std::vector<std::string>> namesOf;  // trained name -> its aliases
  for (const auto& [alias, target] : state.aliases) namesOf[target].push_back(alias);
  for (const auto& b : buckets) {
    auto& taken = match.params.emplace_back();
    for (const auto& p : b.layout().params()) {
      std::vector<std::string> names{p.name};
      const auto it = namesOf.find(p.name);
      if (it != namesOf.end()) names.insert(names.end(), it->second.begin(), it->second.end());
      taken.push_back(take(names, p.shape));
      const auto* src = taken.back();
      TORCH_CHECK(src == nullptr || at::isFloatingType(src->entry->dtype), "zeroshard: tensor '", src->entry->name,
                  "' in '", files.file(src->file).path(), "' is ", src->entry->dtype, ", but the model trains '",
                  p.name, "' and needs a floating-point value");
    }
  }
  // A module-state tensor under several names (a tied frozen weight) is one piece.
  match.moduleState.assign(state.tensors.size(), nullptr);
  std::unordered_map<const void*, size_t> first;
  std::vector<std::vector<std::string>> groups(state.tensors.size());
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const auto [it, added] = first.emplace(state.tensors[i].second.unsafeGetTensorImpl(), i);
    groups[it->second].push_back(state.tensors[i].first);
  }
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (!groups[i].empty()) match.moduleState[i] = take(groups[i], state.tensors[i].second.sizes().vec());
  }
  // Stage 3's sharded frozen parameters, each under all its state-dict names (tied: one piece).
  match.frozen.resize(frozenBuckets.size());
  for (size_t b = 0; b < frozenBuckets.size(); ++b) {
    std::vector<std::vector<std::string>> namesOf(frozenBuckets[b].size());
    for (const auto& entry : state.sharded) {
      if (entry.bucket == b) namesOf[entry.param].push_back(entry.name);
    }
    for (size_t i = 0; i < namesOf.size(); ++i) {
      const auto& shape = frozenBuckets[b].layout().params()[i].shape;
      const auto* src = namesOf[i].empty() ? nullptr : take(namesOf[i], shape);
      TORCH_CHECK(src == nullptr || at::isFloatingType(src->entry->dtype), "zeroshard: tensor '", src->entry->name,
                  "' in '", files.file(src->file).path(), "' is ", src->entry->dtype, ", but the model holds '",
                  namesOf[i].front(), "' as a frozen floating-point parameter");
      match.frozen[b].push_back(src);
    }
  }
  for (const auto& key : state.keys) known.insert(key);
  for (const auto& name : files.names()) {
    const std::string& as = modelName(name);
    if (!known.count(as) || find(as)->entry->name != name) match.unexpected.push_back(name);
  }

  // Missing and mismatched in the model's state-dict order (the buckets' order differs from it).
  std::unordered_map<std::string, size_t> order;
  for (size_t i = 0; i < state.keys.size(); ++i) order.emplace(state.keys[i], i);
  auto position = [&](const std::string& name) {
    const auto it = order.find(name);
    return it == order.end() ? std::numeric_limits<size_t>::max() : it->second;
  };
  std::stable_sort(match.missing.begin(), match.missing.end(),
                   [&](const std::string& a, const std::string& b) { return position(a) < position(b); });
  std::stable_sort(match.mismatched.begin(), match.mismatched.end(),
                   [&](const ShapeMismatch& a, const ShapeMismatch& b) { return position(a.name) < position(b.name); });
  return match;
}

std::string describeMismatch(const std::string& path, const PretrainedMatch& match, const TensorRenames& renames) {
  std::ostringstream out;
  auto both = [&](const std::string& fileName) {
    const auto it = renames.find(fileName);
    if (it != renames.end() && it->second != fileName) out << fileName << " (as " << it->second << ")";
    else out << fileName;
  };
  out << "'" << path << "' does not fit the model (strict=True):";
  auto list = [&](const char* what, size_t n, const std::function<void(size_t)>& item) {
    out << " " << n << " " << what;
    for (size_t i = 0; i < std::min(n, kListedNames); ++i) {
      out << (i == 0 ? ": " : ", ");
      item(i);
    }
    if (n > kListedNames) out << " and " << n - kListedNames << " more";
    out << ";";
  };
  list("missing", match.missing.size(), [&](size_t i) { out << match.missing[i]; });
  list("unexpected", match.unexpected.size(), [&](size_t i) { both(match.unexpected[i]); });
  list("with another shape", match.mismatched.size(), [&](size_t i) {
    const auto& m = match.mismatched[i];
    if (m.fileName.empty()) out << m.name << " (file ";
    else out << m.fileName << " (as " << m.name << "; file ";
    out << c10::IntArrayRef(m.fileShape) << ", model " << c10::IntArrayRef(m.modelShape)
        << ")";
  });
  out << " load_pretrained(path, strict=False) loads the tensors that fit and returns these lists";
  return out.str();
}

} // namespace zeroshard
