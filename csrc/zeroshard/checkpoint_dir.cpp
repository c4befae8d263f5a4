#include "zeroshard/checkpoint_dir.h"

#include <c10/util/Exception.h>

#include "zeroshard/checked_file.h"
#include "zeroshard/checkpoint_manifest.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLatestFile = "latest";
constexpr const char* kStagingPrefix = ".staging-";
constexpr const char* kTrashPrefix = ".trash-";

std::string readText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Moves a checkpoint out of sight in one rename, then deletes it: a crash while deleting leaves
// a .trash- directory (removed by the next save), never a half-deleted checkpoint.
void removeCheckpoint(const fs::path& dir, const std::string& name) {
  const fs::path trash = dir / (kTrashPrefix + name);
  fs::remove_all(trash);
  fs::rename(dir / name, trash);
  syncDirectory(dir.string());
  fs::remove_all(trash);
}

} // namespace

void checkTag(const std::string& tag) {
  TORCH_CHECK(!tag.empty() && tag.find('/') == std::string::npos && tag[0] != '.' && tag != kLatestFile &&
                  tag.find('\0') == std::string::npos,
              "zeroshard checkpoint: tag '", tag, "' cannot name a checkpoint directory; use a non-empty name "
              "without '/', not starting with '.', and not 'latest' (e.g. 'global_step100')");
}

std::string checkpointPath(const std::string& dir, const std::string& tag) {
  return (fs::path(dir) / tag).string();
}

std::string stagingPath(const std::string& dir, const std::string& tag) {
  return (fs::path(dir) / (kStagingPrefix + tag)).string();
}

void prepareStaging(const std::string& dir, const std::string& tag) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, "zeroshard checkpoint: cannot create directory '", dir, "': ", ec.message());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kStagingPrefix, 0) == 0 || name.rfind(kTrashPrefix, 0) == 0) fs::remove_all(entry.path());
  }
  fs::create_directory(stagingPath(dir, tag), ec);
  TORCH_CHECK(!ec, "zeroshard checkpoint: cannot create '", stagingPath(dir, tag), "': ", ec.message());
}

void publishCheckpoint(const std::string& dir, const std::string& tag) {
  const fs::path root(dir);
  syncDirectory(stagingPath(dir, tag));
  const fs::path target = root / tag;
  // An older checkpoint of the same tag goes only once the new one is complete.
  const bool replacing = fs::exists(target);
  if (replacing) fs::rename(target, root / (kTrashPrefix + tag));
  fs::rename(stagingPath(dir, tag), target);
  syncDirectory(dir);

  const fs::path latestStaging = root / (std::string(kStagingPrefix) + kLatestFile);
  writeCheckedFile(latestStaging.string(), kLatestFile, tag);
  fs::rename(latestStaging, root / kLatestFile);
  syncDirectory(dir);
  if (replacing) fs::remove_all(root / (kTrashPrefix + tag));
}

std::string readLatestTag(const std::string& dir) {
  const fs::path latest = fs::path(dir) / kLatestFile;
  TORCH_CHECK(fs::exists(latest), "zeroshard checkpoint: no checkpoint in '", dir, "' (no '", kLatestFile,
              "' file); save one first or pass the tag to load");
  std::string tag = readText(latest);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ')) tag.pop_back();
  checkTag(tag);
  return tag;
}

std::vector<std::string> pruneCheckpoints(const std::string& dir, int64_t keepLast, const std::string& keepTag) {
  std::vector<std::string> removed;
  if (keepLast <= 0) return removed;
  std::vector<std::pair<int64_t, std::string>> complete;  // (created, tag)
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const fs::path manifest = entry.path() / kManifestFile;
    if (name.empty() || name[0] == '.' || !entry.is_directory() || !fs::exists(manifest)) continue;
    try {
      complete.emplace_back(CheckpointManifest::fromJsonText(readText(manifest), manifest.string()).createdUnixNs,
                            name);
    } catch (const c10::Error&) {
      // Not a checkpoint this save can vouch for: left for a person to look at, never removed.
    }
  }
  std::sort(complete.begin(), complete.end(), std::greater<>());
  int64_t kept = 0;
  for (const auto& [created, name] : complete) {
    if (name == keepTag || kept < keepLast) {
      ++kept;
      continue;
    }
    removeCheckpoint(dir, name);
    removed.push_back(name);
  }
  return removed;
}

} // namespace zeroshard
