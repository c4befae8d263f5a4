#include "zeroshard/checkpoint/directory.h"

#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/checked_file.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/remove_tree.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace zeroshard {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLatestFile = "latest";
constexpr const char* kStagingPrefix = ".staging-";
constexpr const char* kTrashPrefix = ".trash-";
constexpr const char* kDefaultTagPrefix = "global_step";

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
  removeTree(trash.string());
  fs::rename(dir / name, trash);
  syncDirectory(dir.string());
  removeTree(trash.string());
}

} // namespace

void checkTag(const std::string& tag) {
  const bool allowed = !tag.empty() && tag[0] != '.' && tag != kLatestFile &&
                       std::all_of(tag.begin(), tag.end(), [](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
                       });
  TORCH_CHECK(allowed, "zeroshard checkpoint: tag '", tag, "' cannot name a checkpoint directory; use letters, "
              "digits, '.', '_' and '-' only, not starting with '.', and not 'latest' (e.g. 'global_step100')");
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
    if (name.rfind(kStagingPrefix, 0) == 0) {
      removeTree(entry.path().string());  // a save that never published
    } else if (name.rfind(kTrashPrefix, 0) == 0) {
      // A checkpoint on its way out. If its own name is free, a publish that replaced it died
      // half way (Note [crash-safe publish]): it is still the complete one, so it goes back.
      const fs::path original = entry.path().parent_path() / name.substr(std::strlen(kTrashPrefix));
      if (fs::exists(original)) {
        removeTree(entry.path().string());
      } else {
        fs::rename(entry.path(), original);
      }
    }
  }
  fs::create_directory(stagingPath(dir, tag), ec);
  TORCH_CHECK(!ec, "zeroshard checkpoint: cannot create '", stagingPath(dir, tag), "': ", ec.message());
}

void discardStaging(const std::string& dir, const std::string& tag) noexcept {
  std::error_code ec;
  removeTree(stagingPath(dir, tag), ec);
  removeTree((fs::path(dir) / (std::string(kStagingPrefix) + kLatestFile)).string(), ec);
}

void publishCheckpoint(const std::string& dir, const std::string& tag) {
  const fs::path root(dir);
  const std::string staged = stagingPath(dir, tag);
  syncDirectory(staged);
  // The save's last write: after it only renames, which need no space (Note [crash-safe publish]).
  const fs::path latestStaging = root / (std::string(kStagingPrefix) + kLatestFile);
  writeCheckedFile(latestStaging.string(), kLatestFile, tag);
  const fs::path target = root / tag;
  if (fs::exists(target)) {
    // Replacing a checkpoint of the same tag: one atomic exchange, so `tag` always names a
    // complete checkpoint; the old one is then in the staging name, removed below.
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      TORCH_CHECK(errno == EINVAL || errno == ENOSYS, "zeroshard checkpoint: replacing '", target.string(),
                  "' failed: ", std::strerror(errno));
      // No exchange on this file system: move the old one aside first. A crash between the two
      // renames leaves it as .trash-<tag>, which the next save puts back.
      fs::rename(target, root / (kTrashPrefix + tag));
      fs::rename(staged, target);
    }
  } else {
    fs::rename(staged, target);
  }
  syncDirectory(dir);
  fs::rename(latestStaging, root / kLatestFile);
  syncDirectory(dir);
  removeTree(staged);  // the replaced checkpoint, if there was one
  removeTree((root / (kTrashPrefix + tag)).string());
}

std::string readLatestTag(const std::string& dir) {
  const fs::path latest = fs::path(dir) / kLatestFile;
  TORCH_CHECK(fs::exists(latest), "zeroshard checkpoint: no checkpoint in '", dir, "' (no '", kLatestFile,
              "' file); save one first or pass the tag to load");
  std::string tag = readText(latest);
  while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
  TORCH_CHECK(!tag.empty(), "zeroshard checkpoint: '", latest.string(), "' is empty; pass the tag to load");
  checkTag(tag);
  return tag;
}

std::vector<std::string> pruneCheckpoints(const std::string& dir, int64_t keepLast, const std::string& keepTag) {
  std::vector<std::string> removed;
  if (keepLast <= 0) return removed;
  std::vector<std::pair<int64_t, std::string>> automatic;  // (step, tag)
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const auto step = defaultTagStep(name);
    if (!step || !entry.is_directory() || !fs::exists(entry.path() / kManifestFile)) continue;
    automatic.emplace_back(*step, name);
  }
  std::sort(automatic.begin(), automatic.end(), std::greater<>());
  int64_t kept = 0;
  for (const auto& [step, name] : automatic) {
    if (name == keepTag || kept < keepLast) {
      ++kept;
      continue;
    }
    removeCheckpoint(dir, name);
    removed.push_back(name);
  }
  return removed;
}

std::string defaultTag(int64_t step) {
  return std::string(kDefaultTagPrefix) + std::to_string(step);
}

std::optional<int64_t> defaultTagStep(const std::string& tag) {
  const size_t prefix = std::strlen(kDefaultTagPrefix);
  if (tag.size() <= prefix || tag.compare(0, prefix, kDefaultTagPrefix) != 0 || tag.size() - prefix > 18) {
    return std::nullopt;
  }
  int64_t step = 0;
  for (size_t i = prefix; i < tag.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(tag[i]))) return std::nullopt;
    step = step * 10 + (tag[i] - '0');
  }
  return step;
}

} // namespace zeroshard
