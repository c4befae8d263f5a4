// A fresh directory under the system temp dir, removed with everything in it at scope exit.
#pragma once

#include "zeroshard/checkpoint/remove_tree.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace zeroshard::testing {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("zeroshard-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    zeroshard::removeTree(path_.string());  // Note [trees without std::filesystem]
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    zeroshard::removeTree(path_.string(), ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

} // namespace zeroshard::testing
