#include "zeroshard/checkpoint/safetensors_file.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace zeroshard {

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "zeroshard: cannot open '", path_, "': ", std::strerror(errno));
  struct stat st{};
  const bool statted = ::fstat(fd_, &st) == 0;
  if (!statted || !S_ISREG(st.st_mode)) {
    const std::string why = statted ? "not a regular file" : std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(false, "zeroshard: cannot read '", path_, "': ", why);
  }
  size_ = static_cast<int64_t>(st.st_size);
  try {
    header_ = readSafetensorsHeader(path_, size_, [&](int64_t offset, int64_t size, void* out) {
      readBytes(offset, size, out);
      headerBytesRead_ += size;
    });
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  const auto it = header_.index.find(name);
  return it == header_.index.end() ? nullptr : &header_.entries[it->second];
}

void SafetensorsFile::readBytes(int64_t offset, int64_t size, void* out) {
  char* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd_, p + done, static_cast<size_t>(size - done), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "zeroshard: reading bytes [", offset, ", ", offset + size, ") of '", path_, "' failed after ",
                done, ": ", n < 0 ? std::strerror(errno) : "the file ended (was it truncated while being read?)");
    done += n;
  }
}

void SafetensorsFile::readFloat(const TensorEntry& entry, int64_t first, int64_t count, float* out) {
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= entry.numel(), "zeroshard: elements [", first, ", ",
              first + count, ") of '", entry.name, "' in '", path_, "' are outside its ", entry.numel());
  TORCH_CHECK(at::isFloatingType(entry.dtype), "zeroshard: tensor '", entry.name, "' in '", path_, "' is ",
              entry.dtype, ", not floating-point");
  const int64_t size = static_cast<int64_t>(c10::elementSize(entry.dtype));
  const int64_t start = header_.dataStart + entry.begin + first * size;
  if (entry.dtype == at::kFloat) {
    readBytes(start, count * size, out);
    dataBytesRead_ += count * size;
    return;
  }
  // Staged a piece at a time in the file's dtype, so a conversion never holds more than one
  // piece beside the fp32 output.
  const int64_t piece = std::max<int64_t>(1, kConvertChunkBytes / size);
  std::vector<char> staging(static_cast<size_t>(std::min(piece, count) * size));
  for (int64_t done = 0; done < count; done += piece) {
    const int64_t n = std::min(piece, count - done);
    readBytes(start + done * size, n * size, staging.data());
    dataBytesRead_ += n * size;
    const auto cpu = at::TensorOptions().device(at::kCPU);
    at::from_blob(out + done, {n}, cpu.dtype(at::kFloat))
        .copy_(at::from_blob(staging.data(), {n}, cpu.dtype(entry.dtype)));
  }
}

at::Tensor SafetensorsFile::read(const TensorEntry& entry) {
  at::Tensor out = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
  const int64_t bytes = entry.end - entry.begin;
  readBytes(header_.dataStart + entry.begin, bytes, out.data_ptr());
  dataBytesRead_ += bytes;
  return out;
}

} // namespace zeroshard
