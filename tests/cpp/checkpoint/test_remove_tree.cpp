#include "catch.h"

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/remove_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <fstream>
#include <string>

using namespace zeroshard;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

namespace fs = std::filesystem;

void writeFile(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

bool present(const fs::path& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0;
}

// A chain of directories whose full path is longer than PATH_MAX, made one level at a time
// relative to the parent's descriptor (a path that long cannot be named in one call).
void makeDeepChain(const fs::path& root, int levels, const std::string& name) {
  int fd = ::open(root.c_str(), O_DIRECTORY | O_RDONLY);
  REQUIRE(fd >= 0);
  for (int i = 0; i < levels; ++i) {
    REQUIRE(::mkdirat(fd, name.c_str(), 0700) == 0);
    const int child = ::openat(fd, name.c_str(), O_DIRECTORY | O_RDONLY);
    ::close(fd);
    REQUIRE(child >= 0);
    fd = child;
  }
  const int file = ::openat(fd, "leaf", O_CREAT | O_WRONLY, 0600);
  REQUIRE(file >= 0);
  ::close(file);
  ::close(fd);
}

// Undoes makeDeepChain the same way (relative to descriptors), so the test leaves nothing.
void removeDeepChain(int parent, const std::string& name) {
  const int fd = ::openat(parent, name.c_str(), O_DIRECTORY | O_RDONLY);
  if (fd < 0) {
    ::unlinkat(parent, name.c_str(), 0);
    return;
  }
  DIR* dir = ::fdopendir(fd);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string child = entry->d_name;
    if (child == "." || child == "..") continue;
    removeDeepChain(fd, child);
  }
  ::closedir(dir);
  ::unlinkat(parent, name.c_str(), AT_REMOVEDIR);
}

} // namespace

TEST_CASE("removeTree removes nested directories and files, deepest first", "[checkpoint][remove_tree]") {
  TempDir tmp;
  const fs::path tree = tmp.path() / "tree";
  fs::create_directories(tree / "a" / "b" / "c");
  fs::create_directories(tree / "empty");
  writeFile(tree / "top.txt", "top");
  writeFile(tree / "a" / ".hidden", "h");
  writeFile(tree / "a" / "b" / "c" / "deep.bin", std::string(1 << 16, 'x'));

  removeTree(tree.string());
  CHECK_FALSE(present(tree));
  CHECK(present(tmp.path()));  // only what was named goes

  writeFile(tmp.path() / "plain", "file");  // a file is a tree of one entry
  std::error_code ec;
  CHECK(removeTree((tmp.path() / "plain").string(), ec));
  CHECK_FALSE(ec);
  CHECK_FALSE(present(tmp.path() / "plain"));
}

TEST_CASE("removeTree removes symbolic links and never what they point to", "[checkpoint][remove_tree]") {
  TempDir tmp;
  const fs::path outside = tmp.path() / "outside";
  fs::create_directories(outside / "kept");
  writeFile(outside / "kept" / "data.txt", "precious");
  writeFile(tmp.path() / "outside_file", "precious too");
  const fs::path tree = tmp.path() / "tree";
  fs::create_directories(tree / "sub");
  fs::create_directory_symlink(outside, tree / "sub" / "to_outside");
  fs::create_symlink(tmp.path() / "outside_file", tree / "to_file");
  fs::create_symlink(tmp.path() / "nowhere", tree / "dangling");

  removeTree(tree.string());
  CHECK_FALSE(present(tree));
  CHECK(present(outside / "kept" / "data.txt"));
  CHECK(present(tmp.path() / "outside_file"));

  // The named path itself a link to a directory: the link goes, the directory stays.
  const fs::path link = tmp.path() / "link";
  fs::create_directory_symlink(outside, link);
  removeTree(link.string());
  CHECK_FALSE(present(link));
  CHECK(present(outside / "kept" / "data.txt"));
}

TEST_CASE("removeTree of a missing path succeeds and removes nothing", "[checkpoint][remove_tree]") {
  TempDir tmp;
  writeFile(tmp.path() / "neighbour", "n");
  std::error_code ec = std::make_error_code(std::errc::io_error);  // cleared on success
  CHECK(removeTree((tmp.path() / "missing").string(), ec));
  CHECK_FALSE(ec);
  CHECK(errorText([&] { removeTree((tmp.path() / "missing").string()); }).empty());
  CHECK(present(tmp.path() / "neighbour"));
}

TEST_CASE("removeTree reports what it cannot remove, with the path and the reason", "[checkpoint][remove_tree]") {
  TempDir tmp;
  SECTION("the path cannot be looked up") {
    writeFile(tmp.path() / "file", "f");
    const std::string below = (tmp.path() / "file" / "child").string();
    std::error_code ec;
    CHECK_FALSE(removeTree(below, ec));
    CHECK(ec == std::errc::not_a_directory);
    const std::string message = errorText([&] { removeTree(below); });
    CHECK(contains(message, "cannot remove '" + below + "'"));
    CHECK(contains(message, ec.message()));
  }
  SECTION("an entry inside the tree cannot be removed") {
    // Root may remove anything it can name, so the failure that holds for every user is a name
    // too long to pass to remove(): entries deeper than PATH_MAX bytes.
    const fs::path tree = tmp.path() / "tree";
    fs::create_directory(tree);
    const std::string level(200, 'd');
    makeDeepChain(tree, PATH_MAX / 200 + 2, level);
    std::error_code ec;
    CHECK_FALSE(removeTree(tree.string(), ec));
    CHECK(ec == std::errc::filename_too_long);
    CHECK(contains(errorText([&] { removeTree(tree.string()); }), "cannot remove '" + tree.string() + "'"));
    CHECK(present(tree));  // stopped at the failure: the part it could not reach is still there
    const int fd = ::open(tmp.path().c_str(), O_DIRECTORY | O_RDONLY);
    REQUIRE(fd >= 0);
    removeDeepChain(fd, "tree");
    ::close(fd);
    CHECK_FALSE(present(tree));
  }
}
