#include "zeroshard/checkpoint/reader.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/directory.h"
#include "zeroshard/layout/flat_layout.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

std::string readManifestText(const std::string& path, const std::string& checkpoint) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "zeroshard checkpoint: '", path, "' is missing, so '", checkpoint,
              "' is not a complete checkpoint (a save that did not finish never gets a manifest)");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

} // namespace

CheckpointReader::CheckpointReader(const std::string& dir, const std::optional<std::string>& tag) {
  TORCH_CHECK(fs::is_directory(dir), "zeroshard checkpoint: '", dir, "' is not a directory");
  // A path that is itself a checkpoint (it has a manifest) is accepted as well as its parent.
  const bool isCheckpoint = !tag && fs::exists(fs::path(dir) / kManifestFile);
  const std::string resolved = isCheckpoint ? "" : tag ? *tag : readLatestTag(dir);
  if (!isCheckpoint) checkTag(resolved);
  path_ = isCheckpoint ? dir : checkpointPath(dir, resolved);
  const std::string manifestPath = (fs::path(path_) / kManifestFile).string();
  manifest_ = CheckpointManifest::fromJsonText(readManifestText(manifestPath, path_), manifestPath);
  checkClaimsAgainstFiles();
  for (size_t i = 0; i < manifest_.params.size(); ++i) paramIndex_[manifest_.params[i].name] = i;
}

// Note [claims backed by files]: the manifest's sizes are claims; the rank files on disk are
// what the checkpoint holds. Each rank file must have the size the manifest records (its reader
// checks that again, with every chunk's checksum, when it opens it) and room for three fp32
// tensors of every buffer's shard_numel. A buffer, and so any parameter in it (manifest.cpp
// holds parameters inside their buffers), then has at most as many elements as the files have
// bytes, so what readers allocate for a parameter, or convert for the largest one, is bounded by
// the checkpoint's real size, never by a number in a damaged manifest.
void CheckpointReader::checkClaimsAgainstFiles() const {
  int64_t stateBytes = 0;
  for (const auto& b : manifest_.buffers) {
    // manifest.cpp bounds each shard_numel by INT64_MAX / 12 / world_size.
    TORCH_CHECK(!__builtin_add_overflow(stateBytes, b.shardNumel * 12, &stateBytes), "zeroshard checkpoint '", path_,
                "': the manifest's buffers hold more than 2^63 bytes");
  }
  for (int rank = 0; rank < manifest_.worldSize; ++rank) {
    const std::string name = CheckpointManifest::rankFileName(rank);
    const FileDigest& recorded = digest(name);
    std::error_code ec;
    const auto onDisk = fs::file_size(fs::path(path_) / name, ec);
    TORCH_CHECK(!ec, "zeroshard checkpoint: file '", (fs::path(path_) / name).string(), "' is missing or unreadable (",
                ec.message(), "); the checkpoint is incomplete");
    TORCH_CHECK(onDisk == static_cast<uintmax_t>(recorded.bytes) && stateBytes <= recorded.bytes, "zeroshard checkpoint: '",
                (fs::path(path_) / name).string(), "' has ", onDisk, " bytes; the manifest records ", recorded.bytes,
                " and its buffers need ", stateBytes, " of them; the checkpoint is damaged");
  }
}

const FileDigest& CheckpointReader::digest(const std::string& name) const {
  TORCH_CHECK(manifest_.hasFile(name), "zeroshard checkpoint '", path_, "': the manifest lists no file '", name,
              "'; the checkpoint is damaged");
  return manifest_.file(name);
}

const SavedParam* CheckpointReader::findParam(const std::string& name) const {
  auto it = paramIndex_.find(name);
  return it == paramIndex_.end() ? nullptr : &manifest_.params[it->second];
}

SafetensorsReader& CheckpointReader::rankFile(int rank) {
  auto it = std::find_if(rankFiles_.begin(), rankFiles_.end(), [&](const auto& f) { return f.first == rank; });
  if (it != rankFiles_.end()) {
    std::rotate(it, it + 1, rankFiles_.end());  // now the most recently used
    return *rankFiles_.back().second;
  }
  if (rankFiles_.size() == kOpenRankFiles) rankFiles_.erase(rankFiles_.begin());
  const std::string name = CheckpointManifest::rankFileName(rank);
  rankFiles_.emplace_back(rank, std::make_unique<SafetensorsReader>((fs::path(path_) / name).string(),
                                                                    digest(name)));
  return *rankFiles_.back().second;
}

void CheckpointReader::readParam(const SavedParam& param, const std::string& kind, int64_t begin, int64_t end,
                                 float* out) {
  TORCH_CHECK(begin >= 0 && begin <= end && end <= param.numel(), "zeroshard checkpoint: elements [", begin, ", ",
              end, ") of '", param.name, "' are outside its ", param.numel());
  const int64_t shard = manifest_.buffers.at(param.buffer).shardNumel;
  const std::string tensor = CheckpointManifest::stateTensorName(param.buffer, kind);
  // The parameter's range of the saved flat buffer, cut at the saved ranks' shard boundaries.
  for (const auto& span : FlatLayout::spansOf(param.offset + begin, param.offset + end, shard)) {
    auto& file = rankFile(span.rank);
    TORCH_CHECK(file.entry(tensor).dtype == at::kFloat, "zeroshard checkpoint: '", tensor, "' is not float32");
    file.readElements(tensor, span.offset, span.numel, out);
    out += span.numel;
  }
}

at::Tensor CheckpointReader::readParam(const std::string& name) {
  const SavedParam* param = findParam(name);
  TORCH_CHECK(param, "zeroshard checkpoint '", path_, "' has no parameter '", name, "'");
  at::Tensor out = at::empty(param->shape, at::TensorOptions().dtype(at::kFloat));
  readParam(*param, "master", 0, param->numel(), out.data_ptr<float>());
  return out;
}

SafetensorsReader& CheckpointReader::moduleStateFile() {
  if (!moduleState_) {
    moduleState_ = std::make_unique<SafetensorsReader>((fs::path(path_) / kModuleStateFile).string(),
                                                       digest(kModuleStateFile));
  }
  return *moduleState_;
}

at::Tensor CheckpointReader::readModuleState(const std::string& name) {
  return moduleStateFile().read(name);
}

void CheckpointReader::readModuleStateElements(const std::string& name, int64_t first, int64_t count, void* out) {
  moduleStateFile().readElements(name, first, count, out);
}

std::string CheckpointReader::readClientState() {
  if (!manifest_.hasFile(kClientStateFile)) return {};
  return readCheckedFile((fs::path(path_) / kClientStateFile).string(), digest(kClientStateFile));
}

std::vector<std::string> CheckpointReader::stateDictNames() const {
  if (!manifest_.stateDictKeys.empty()) return manifest_.stateDictKeys;
  std::vector<std::string> names;
  for (const auto& p : manifest_.params) names.push_back(p.name);
  for (const auto& [alias, target] : manifest_.aliases) names.push_back(alias);
  for (const auto& t : manifest_.moduleState) names.push_back(t.name);
  return names;
}

const SavedParam* CheckpointReader::paramOfStateDictEntry(const std::string& name) const {
  if (const SavedParam* param = findParam(name)) return param;
  for (const auto& [alias, target] : manifest_.aliases) {
    if (alias == name) return findParam(target);
  }
  return nullptr;
}

at::Tensor CheckpointReader::readStateDictEntry(const std::string& name) {
  const SavedParam* param = paramOfStateDictEntry(name);
  return param ? readParam(param->name) : readModuleState(name);
}

} // namespace zeroshard
