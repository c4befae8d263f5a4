#include "zeroshard/checkpoint/remove_tree.h"

#include <c10/util/Exception.h>

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

namespace zeroshard {
namespace {

// nftw's callback has no user argument, so the first failure travels back as its return value:
// a non-zero return stops the walk and becomes nftw's own (errno values are positive; nftw's
// failures of its own are -1 with errno set). An entry already gone is what was wanted.
int removeEntry(const char* path, const struct stat*, int, struct FTW*) {
  return std::remove(path) == 0 || errno == ENOENT ? 0 : errno;
}

// Directories nftw keeps open at once; a deeper tree is walked too, reopening as it goes.
constexpr int kOpenDirectories = 16;

} // namespace

bool removeTree(const std::string& path, std::error_code& ec) noexcept {
  ec.clear();
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return !ec;
  }
  // FTW_DEPTH: a directory after its contents; FTW_PHYS: a symlink is an entry, not followed.
  const int rc = ::nftw(path.c_str(), removeEntry, kOpenDirectories, FTW_DEPTH | FTW_PHYS);
  if (rc > 0) ec.assign(rc, std::generic_category());
  if (rc < 0) ec.assign(errno, std::generic_category());
  return !ec;
}

void removeTree(const std::string& path) {
  std::error_code ec;
  TORCH_CHECK(removeTree(path, ec), "zeroshard: cannot remove '", path, "' and what is under it: ", ec.message(),
              " (check its permissions, or remove it by hand)");
}

} // namespace zeroshard
