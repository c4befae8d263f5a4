// The safetensors file format (an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes), written as a stream and read in
// slices, on top of CheckedFileWriter / CheckedFileReader. Files written here load with the
// `safetensors` package (safetensors.torch.load_file) and Hugging Face tooling.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/checked_file.h"

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace zeroshard {

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte range after the header, end exclusive
  int64_t end = 0;
  int64_t numel() const;
};

// The safetensors name of a dtype ("F32", "BF16", ...), and back; and torch's ("float32", ...).
std::string safetensorsDtype(at::ScalarType dtype);
at::ScalarType dtypeFromSafetensors(const std::string& name);
std::string dtypeName(at::ScalarType dtype);
at::ScalarType dtypeFromName(const std::string& name);

// Writes the header for `entries` (their byte ranges are assigned here, in order) on
// construction; then each tensor's bytes, in the same order, through write().
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<TensorEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  // The next tensor: any device or layout; its dtype and element count must match the entry.
  void write(const at::Tensor& tensor);
  FileDigest finish(const std::string& name);

 private:
  CheckedFileWriter file_;
  std::vector<TensorEntry> entries_;
  size_t next_ = 0;
};

class SafetensorsReader {
 public:
  SafetensorsReader(const std::string& path, FileDigest expected);

  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  // Throws naming the file when `name` is not in it.
  const TensorEntry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Elements [first, first + count) of tensor `name` (flattened) into `out`, which must hold
  // count elements of the tensor's dtype.
  void readElements(const std::string& name, int64_t first, int64_t count, void* out);
  // The whole tensor, on CPU.
  at::Tensor read(const std::string& name);

 private:
  CheckedFileReader file_;
  int64_t dataStart_ = 0;
  std::vector<TensorEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

} // namespace zeroshard
