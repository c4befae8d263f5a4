// The safetensors file format (an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes), written as a stream and read in
// slices, on top of CheckedFileWriter / CheckedFileReader. Files written here load with the
// `safetensors` package (safetensors.torch.load_file) and Hugging Face tooling.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/checked_file.h"

#include <functional>
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

// A safetensors header, read and checked against the file it came from.
struct SafetensorsHeader {
  int64_t dataStart = 0;  // the file offset of the data area: 8 + the header's length
  std::vector<TensorEntry> entries;  // in the header's order
  std::unordered_map<std::string, size_t> index;  // name -> entries[i]
  std::map<std::string, std::string> metadata;
};

// Reads the header of the safetensors file `path` of `fileBytes` bytes through read(offset,
// size, out), checking it before trusting it: the 8-byte length fits the file (nothing of the
// length it claims is allocated before that), the JSON parses, every dtype is known, every
// shape's byte length equals its byte range and every range lies inside the data area. Errors
// name the file (and the tensor).
SafetensorsHeader readSafetensorsHeader(const std::string& path, int64_t fileBytes,
                                        const std::function<void(int64_t offset, int64_t size, void* out)>& read);

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

  bool contains(const std::string& name) const { return header_.index.count(name) > 0; }
  // Throws naming the file when `name` is not in it.
  const TensorEntry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  // Elements [first, first + count) of tensor `name` (flattened) into `out`, which must hold
  // count elements of the tensor's dtype.
  void readElements(const std::string& name, int64_t first, int64_t count, void* out);
  // The whole tensor, on CPU.
  at::Tensor read(const std::string& name);

 private:
  CheckedFileReader file_;
  SafetensorsHeader header_;
};

} // namespace zeroshard
