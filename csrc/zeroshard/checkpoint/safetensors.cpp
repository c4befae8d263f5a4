#include "zeroshard/checkpoint/safetensors.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>

#include "zeroshard/config/json_input.h"

namespace zeroshard {
namespace {

using Json = nlohmann::ordered_json;

// Each dtype a checkpoint may hold: its safetensors name and the name torch prints.
struct DtypeNames {
  at::ScalarType type;
  const char* safetensors;
  const char* torch;
};
constexpr DtypeNames kDtypes[] = {
    {at::kFloat, "F32", "float32"}, {at::kBFloat16, "BF16", "bfloat16"}, {at::kHalf, "F16", "float16"},
    {at::kDouble, "F64", "float64"}, {at::kLong, "I64", "int64"},         {at::kInt, "I32", "int32"},
    {at::kShort, "I16", "int16"},   {at::kChar, "I8", "int8"},            {at::kByte, "U8", "uint8"},
    {at::kBool, "BOOL", "bool"},
};

const DtypeNames& namesOf(at::ScalarType dtype) {
  for (const auto& names : kDtypes) {
    if (names.type == dtype) return names;
  }
  TORCH_CHECK(false, "zeroshard: dtype ", dtype, " cannot be saved");
}

at::ScalarType dtypeNamed(const std::string& name, const char* DtypeNames::*field) {
  for (const auto& names : kDtypes) {
    if (name == names.*field) return names.type;
  }
  TORCH_CHECK(false, "zeroshard: unknown or unsupported dtype '", name, "'");
}

// A whole number of a header's "shape" or "data_offsets" (the format's are unsigned 64-bit; any
// past int64_t lies outside every file). A float, a negative or a larger number is an error:
// nlohmann's get<int64_t> would convert a float out of range, which is undefined.
int64_t wholeNumber(const Json& v, const std::string& path, const std::string& name, const char* field) {
  const bool whole = v.is_number_integer() && !v.is_number_float() &&
                     !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()));
  TORCH_CHECK(whole && v.get<int64_t>() >= 0, "zeroshard: tensor '", name, "' in '", path, "' has ", field, " value ",
              shortText(v.dump(), 40), ", not a whole number in [0, 2^63)");
  return v.get<int64_t>();
}

// Header lengths beyond this are not a safetensors file (the format's own reader caps them).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

} // namespace

int64_t TensorEntry::numel() const {
  return c10::multiply_integers(shape);
}

std::string safetensorsDtype(at::ScalarType dtype) { return namesOf(dtype).safetensors; }

at::ScalarType dtypeFromSafetensors(const std::string& name) { return dtypeNamed(name, &DtypeNames::safetensors); }

std::string dtypeName(at::ScalarType dtype) { return namesOf(dtype).torch; }

at::ScalarType dtypeFromName(const std::string& name) { return dtypeNamed(name, &DtypeNames::torch); }

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : file_(path), entries_(std::move(entries)) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (auto& e : entries_) {
    TORCH_CHECK(!header.contains(e.name), "zeroshard: tensor '", e.name, "' written twice to '", path, "'");
    e.begin = offset;
    e.end = offset + e.numel() * static_cast<int64_t>(c10::elementSize(e.dtype));
    offset = e.end;
    header[e.name] = {{"dtype", safetensorsDtype(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  // Padded with spaces so the data starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(length >> (8 * i));
  file_.write(prefix, sizeof(prefix));
  file_.write(text.data(), text.size());
}

void SafetensorsWriter::write(const at::Tensor& tensor) {
  TORCH_CHECK(next_ < entries_.size(), "zeroshard: more tensors than the safetensors header announced");
  const TensorEntry& e = entries_[next_++];
  TORCH_CHECK(tensor.scalar_type() == e.dtype && tensor.numel() == e.numel(), "zeroshard: tensor '", e.name, "' is ",
              tensor.scalar_type(), " with ", tensor.numel(), " elements, the header says ", e.dtype, " with ",
              e.numel());
  const at::Tensor cpu = tensor.device().is_cpu() ? tensor.contiguous() : tensor.to(at::kCPU).contiguous();
  file_.write(cpu.data_ptr(), cpu.nbytes());
}

FileDigest SafetensorsWriter::finish(const std::string& name) {
  TORCH_CHECK(next_ == entries_.size(), "zeroshard: safetensors file '", name, "' got ", next_, " of the ",
              entries_.size(), " tensors its header announced");
  return file_.finish(name);
}

SafetensorsHeader readSafetensorsHeader(const std::string& path, int64_t fileBytes,
                                        const std::function<void(int64_t, int64_t, void*)>& read) {
  TORCH_CHECK(fileBytes >= 8, "zeroshard: '", path, "' is too short to be a safetensors file (", fileBytes,
              " bytes)");
  unsigned char prefix[8];
  read(0, 8, prefix);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(prefix[i]) << (8 * i);
  // Checked before the header is allocated: a garbled prefix must not ask for exabytes.
  TORCH_CHECK(length <= kMaxHeaderBytes && static_cast<int64_t>(length) + 8 <= fileBytes, "zeroshard: '", path,
              "' has a header length of ", length, " bytes, which does not fit the file (", fileBytes,
              " bytes): it is not a safetensors file, or it is truncated");
  std::string text(length, '\0');
  read(8, static_cast<int64_t>(length), text.data());
  SafetensorsHeader out;
  out.dataStart = 8 + static_cast<int64_t>(length);
  const int64_t dataBytes = fileBytes - out.dataStart;
  Json header;
  try {
    header = parseNestingBounded<Json>(text);
  } catch (const std::exception& e) {  // nlohmann's, or JsonTooDeep
    TORCH_CHECK(false, "zeroshard: the safetensors header of '", path, "' is not valid JSON: ", validUtf8(e.what()));
  }
  TORCH_CHECK(header.is_object(), "zeroshard: the safetensors header of '", path, "' is not a JSON object");
  std::string current;  // the entry being read, for the error
  try {
    for (const auto& [name, value] : header.items()) {
      current = name;
      if (name == "__metadata__") {
        out.metadata = value.get<std::map<std::string, std::string>>();
        continue;
      }
      TensorEntry e;
      e.name = name;
      const std::string dtype = value.at("dtype").get<std::string>();
      const DtypeNames* known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                             [&](const DtypeNames& n) { return dtype == n.safetensors; });
      TORCH_CHECK(known != std::end(kDtypes), "zeroshard: tensor '", name, "' in '", path, "' has dtype '", dtype,
                  "', which zeroshard does not read");
      e.dtype = known->type;
      const Json& shape = value.at("shape");
      const Json& offsets = value.at("data_offsets");
      TORCH_CHECK(shape.is_array() && offsets.is_array() && offsets.size() == 2, "zeroshard: tensor '", name, "' in '",
                  path, "' needs \"shape\" as an array and \"data_offsets\" as [begin, end]");
      for (const Json& d : shape) e.shape.push_back(wholeNumber(d, path, name, "shape"));
      e.begin = wholeNumber(offsets[0], path, name, "data_offsets");
      e.end = wholeNumber(offsets[1], path, name, "data_offsets");
      // The byte length of the shape, computed without overflow: any product past the data
      // area is wrong already.
      int64_t bytes = static_cast<int64_t>(c10::elementSize(e.dtype));
      bool fits = true;
      for (const int64_t d : e.shape) fits = fits && d >= 0;
      if (fits && std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end()) bytes = 0;
      for (const int64_t d : e.shape) {
        if (!fits || bytes == 0) break;
        fits = d <= dataBytes / bytes;
        bytes *= d;
      }
      TORCH_CHECK(fits && e.begin >= 0 && e.end >= e.begin && e.end <= dataBytes && e.end - e.begin == bytes,
                  "zeroshard: tensor '", name, "' in '", path, "' (", dtype, " ",
                  c10::IntArrayRef(e.shape), ") has byte range [", e.begin, ", ", e.end,
                  ") that does not match its shape or lies outside the file's ", dataBytes, " data bytes");
      TORCH_CHECK(out.index.emplace(name, out.entries.size()).second, "zeroshard: tensor '", name,
                  "' appears twice in '", path, "'");
      out.entries.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "zeroshard: the safetensors header of '", path, "' is malformed at '", current, "': ",
                validUtf8(e.what()));
  }
  return out;
}

SafetensorsReader::SafetensorsReader(const std::string& path, FileDigest expected)
    : file_(path, std::move(expected)) {
  header_ = readSafetensorsHeader(path, file_.size(),
                                  [&](int64_t offset, int64_t size, void* out) { file_.read(offset, size, out); });
}

const TensorEntry& SafetensorsReader::entry(const std::string& name) const {
  auto it = header_.index.find(name);
  TORCH_CHECK(it != header_.index.end(), "zeroshard: tensor '", name, "' is not in '", file_.path(), "'");
  return header_.entries[it->second];
}

void SafetensorsReader::readElements(const std::string& name, int64_t first, int64_t count, void* out) {
  const TensorEntry& e = entry(name);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= e.numel(), "zeroshard: elements [", first, ", ",
              first + count, ") of '", name, "' in '", file_.path(), "' are outside its ", e.numel());
  const int64_t size = static_cast<int64_t>(c10::elementSize(e.dtype));
  file_.read(header_.dataStart + e.begin + first * size, count * size, out);
}

at::Tensor SafetensorsReader::read(const std::string& name) {
  const TensorEntry& e = entry(name);
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  readElements(name, 0, e.numel(), out.data_ptr());
  return out;
}

} // namespace zeroshard
