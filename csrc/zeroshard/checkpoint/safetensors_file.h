// A safetensors file written by someone else (a Hugging Face checkpoint, safetensors.torch):
// no digest to check it against, so the header is checked instead (readSafetensorsHeader), and
// tensors are read in element ranges straight from the file, converted to fp32 on the way.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/safetensors.h"

#include <cstdint>
#include <string>

namespace zeroshard {

class SafetensorsFile {
 public:
  // Opens `path` and reads its header (blocking). Throws naming the file when it is missing,
  // unreadable or its header is not a valid safetensors header for a file of its size.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  const SafetensorsHeader& header() const { return header_; }
  // nullptr when the file holds no tensor of that name.
  const TensorEntry* find(const std::string& name) const;

  // Elements [first, first + count) of `entry` (flattened), converted to fp32, into `out`:
  // pread of exactly their bytes, in pieces of at most kConvertChunkBytes staged in the file's
  // dtype when it is not fp32. The entry's dtype must be floating-point.
  void readFloat(const TensorEntry& entry, int64_t first, int64_t count, float* out);
  // The whole tensor in the file's dtype, on CPU.
  at::Tensor read(const TensorEntry& entry);

  // Bytes read from the file so far: the header (8-byte length and JSON), and tensor data.
  int64_t headerBytesRead() const { return headerBytesRead_; }
  int64_t dataBytesRead() const { return dataBytesRead_; }

  static constexpr int64_t kConvertChunkBytes = int64_t{4} << 20;

 private:
  void readBytes(int64_t offset, int64_t size, void* out);

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  SafetensorsHeader header_;
  int64_t headerBytesRead_ = 0;
  int64_t dataBytesRead_ = 0;
};

} // namespace zeroshard
