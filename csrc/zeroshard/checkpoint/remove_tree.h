// Removing a directory tree without std::filesystem.
//
// Note [trees without std::filesystem]: the CUDA torch wheels (2.11) export their own copies of
// libstdc++'s std::filesystem functions from libtorch.so. A library loaded beside it binds its
// recursive remove to that copy, which on a libstdc++ older than GCC 13's calls a weak symbol
// that is null there: a segfault in every checkpoint save that prunes, replaces a tag or
// discards its staging directory (the link order does not change which copy wins). POSIX nftw
// and remove are libc's, which torch does not re-export, so zeroshard and its tests remove trees
// only here.
#pragma once

#include <string>
#include <system_error>

namespace zeroshard {

// Removes `path` and, if it is a directory, everything under it, deepest first. Symbolic links
// are removed, never followed (a link to a directory elsewhere leaves that directory alone). A
// path that does not exist is not an error. Blocking; throws c10::Error naming the path and the
// reason when an entry cannot be removed (the walk stops at the first failure).
void removeTree(const std::string& path);

// The same, for callers that go on after a failure (cleanup, destructors): never throws; `ec` is
// cleared on success and holds the first error otherwise. Returns !ec.
bool removeTree(const std::string& path, std::error_code& ec) noexcept;

} // namespace zeroshard
