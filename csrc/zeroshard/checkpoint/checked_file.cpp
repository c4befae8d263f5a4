#include "zeroshard/checkpoint/checked_file.h"

#include <c10/util/Exception.h>

#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/progress.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace zeroshard {
namespace {

std::string errnoText() { return std::strerror(errno); }

// Note [a full disk]: a write that fails for want of space says how much its file system has
// left (statvfs of the file's directory: what an unprivileged process may still use) and what
// to do, so that a person reading any rank's error knows it is the disk and which one.
std::string writeErrorText(const std::string& path, int error) {
  std::string text = std::strerror(error);
  if (error != ENOSPC && error != EDQUOT && error != EFBIG) return text;
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  struct statvfs fsStat{};
  if (::statvfs(dir.c_str(), &fsStat) == 0) {
    const int64_t free = static_cast<int64_t>(fsStat.f_bavail) * static_cast<int64_t>(fsStat.f_frsize);
    text += " (the file system of '" + dir + "' has " + std::to_string(free) + " bytes" +
            (free < 1000 ? "" : " = " + progressBytes(free)) + " free)";
  }
  return text + (error == EFBIG ? "; the file is past this process's file size limit (ulimit -f) or the largest "
                                  "file its file system holds"
                                : "; free some space there or save elsewhere");
}

} // namespace

CheckedFileWriter::CheckedFileWriter(std::string path, int64_t chunkBytes) : path_(std::move(path)) {
  TORCH_CHECK(chunkBytes > 0, "zeroshard checkpoint: chunk size must be > 0");
  digest_.chunkBytes = chunkBytes;
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "zeroshard checkpoint: cannot create '", path_, "': ", writeErrorText(path_, errno));
}

CheckedFileWriter::~CheckedFileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void CheckedFileWriter::write(const void* data, size_t size) {
  TORCH_CHECK(fd_ >= 0, "zeroshard checkpoint: '", path_, "' was already finished");
  const char* p = static_cast<const char*>(data);
  size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "zeroshard checkpoint: writing '", path_, "' failed after ",
                digest_.bytes + (p - static_cast<const char*>(data)), " bytes: ",
                n < 0 ? writeErrorText(path_, errno) : std::string("no progress"));
    p += n;
    left -= static_cast<size_t>(n);
  }
  // The checksum follows chunk boundaries, not the caller's write sizes.
  p = static_cast<const char*>(data);
  left = size;
  while (left > 0) {
    const size_t take = std::min<size_t>(left, static_cast<size_t>(digest_.chunkBytes - chunkFill_));
    chunkCrc_ = crc32Update(chunkCrc_, p, take);
    chunkFill_ += static_cast<int64_t>(take);
    p += take;
    left -= take;
    if (chunkFill_ == digest_.chunkBytes) {
      digest_.chunkCrcs.push_back(chunkCrc_);
      chunkCrc_ = 0;
      chunkFill_ = 0;
    }
  }
  digest_.bytes += static_cast<int64_t>(size);
}

FileDigest CheckedFileWriter::finish(const std::string& name) {
  TORCH_CHECK(fd_ >= 0, "zeroshard checkpoint: '", path_, "' was already finished");
  if (chunkFill_ > 0) digest_.chunkCrcs.push_back(chunkCrc_);
  const int rc = ::fsync(fd_);
  const int syncErrno = errno;
  ::close(fd_);
  fd_ = -1;
  errno = syncErrno;
  // Some file systems (NFS, and any that allocate lazily) report a full disk only here.
  TORCH_CHECK(rc == 0, "zeroshard checkpoint: flushing '", path_, "' to disk failed: ", writeErrorText(path_, errno));
  digest_.name = name;
  return digest_;
}

CheckedFileReader::CheckedFileReader(std::string path, FileDigest expected)
    : path_(std::move(path)), expected_(std::move(expected)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "zeroshard checkpoint: file '", path_, "' is missing or unreadable (", errnoText(),
              "); the checkpoint is incomplete");
  struct stat st{};
  TORCH_CHECK(::fstat(fd_, &st) == 0, "zeroshard checkpoint: cannot stat '", path_, "': ", errnoText());
  TORCH_CHECK(st.st_size == expected_.bytes, "zeroshard checkpoint: file '", path_, "' has ", st.st_size,
              " bytes but the manifest records ", expected_.bytes, st.st_size < expected_.bytes ? " (truncated)" : "",
              "; the checkpoint is damaged");
  const int64_t chunks = expected_.chunkBytes > 0 ? (expected_.bytes + expected_.chunkBytes - 1) / expected_.chunkBytes : -1;
  TORCH_CHECK(chunks >= 0 && static_cast<int64_t>(expected_.chunkCrcs.size()) == chunks,
              "zeroshard checkpoint: the manifest's checksums for '", path_, "' do not cover its ", expected_.bytes,
              " bytes");
}

CheckedFileReader::~CheckedFileReader() {
  if (fd_ >= 0) ::close(fd_);
}

const std::vector<char>& CheckedFileReader::chunk(int64_t index) {
  if (index == cachedIndex_) return cached_;
  const int64_t begin = index * expected_.chunkBytes;
  const int64_t size = std::min(expected_.chunkBytes, expected_.bytes - begin);
  cached_.resize(static_cast<size_t>(size));
  cachedIndex_ = -1;
  int64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd_, cached_.data() + done, static_cast<size_t>(size - done), begin + done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "zeroshard checkpoint: reading '", path_, "' at byte ", begin + done, " failed: ",
                n < 0 ? errnoText() : std::string("unexpected end of file (truncated)"));
    done += n;
  }
  const uint32_t crc = crc32Update(0, cached_.data(), cached_.size());
  TORCH_CHECK(crc == expected_.chunkCrcs[static_cast<size_t>(index)], "zeroshard checkpoint: checksum mismatch in '",
              path_, "' bytes [", begin, ", ", begin + size, "): CRC-32 ", crc32Hex(crc), ", manifest ",
              crc32Hex(expected_.chunkCrcs[static_cast<size_t>(index)]), "; the file is corrupt");
  cachedIndex_ = index;
  return cached_;
}

void CheckedFileReader::read(int64_t offset, int64_t size, void* out) {
  TORCH_CHECK(offset >= 0 && size >= 0 && offset + size <= expected_.bytes, "zeroshard checkpoint: '", path_,
              "': bytes [", offset, ", ", offset + size, ") lie outside its ", expected_.bytes, " bytes");
  char* dst = static_cast<char*>(out);
  while (size > 0) {
    const int64_t index = offset / expected_.chunkBytes;
    const auto& bytes = chunk(index);
    const int64_t within = offset - index * expected_.chunkBytes;
    const int64_t take = std::min(size, static_cast<int64_t>(bytes.size()) - within);
    std::memcpy(dst, bytes.data() + within, static_cast<size_t>(take));
    dst += take;
    offset += take;
    size -= take;
  }
}

FileDigest writeCheckedFile(const std::string& path, const std::string& name, const std::string& bytes) {
  CheckedFileWriter writer(path);
  writer.write(bytes.data(), bytes.size());
  return writer.finish(name);
}

std::string readCheckedFile(const std::string& path, const FileDigest& expected) {
  CheckedFileReader reader(path, expected);
  std::string bytes(static_cast<size_t>(expected.bytes), '\0');
  reader.read(0, expected.bytes, bytes.data());
  return bytes;
}

void syncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "zeroshard checkpoint: cannot open directory '", path, "': ", errnoText());
  const int rc = ::fsync(fd);
  const int syncErrno = errno;
  ::close(fd);
  errno = syncErrno;
  TORCH_CHECK(rc == 0, "zeroshard checkpoint: flushing directory '", path, "' failed: ", errnoText());
}

} // namespace zeroshard
