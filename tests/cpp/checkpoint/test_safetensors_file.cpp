// SafetensorsFile (csrc/zeroshard/checkpoint/safetensors_file.*): safetensors files from outside
// zeroshard, with no digest: the header is checked before it is trusted, and element ranges are
// read straight from the file, converted to fp32, counting exactly the bytes read.
#include <ATen/ATen.h>

#undef CHECK
#include "catch.h"

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/safetensors_file.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using zeroshard::SafetensorsFile;
using zeroshard::SafetensorsWriter;
using zeroshard::TensorEntry;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

// A file of an 8-byte little-endian length (`length`, or the header's own), the header text and
// `dataBytes` zero bytes.
std::string writeRaw(const TempDir& dir, const std::string& header, int64_t dataBytes, uint64_t length = 0) {
  const std::string path = dir / "raw.safetensors";
  std::ofstream out(path, std::ios::binary);
  if (length == 0) length = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << header << std::string(static_cast<size_t>(dataBytes), '\0');
  return path;
}

std::string openError(const std::string& path) {
  return errorText([&] { SafetensorsFile file(path); });
}

} // namespace

TEST_CASE("an external safetensors header is checked before it is trusted", "[safetensors_file]") {
  TempDir dir;
  SECTION("too short for the length prefix") {
    const std::string path = dir / "short.safetensors";
    std::ofstream(path, std::ios::binary) << "abc";
    const auto text = openError(path);
    CHECK(contains(text, "'" + path + "' is too short to be a safetensors file (3 bytes)"));
  }
  SECTION("a header length past the file is refused without allocating it") {
    // 2^62 bytes: allocating it would throw bad_alloc (or worse), not this error.
    const auto text = openError(writeRaw(dir, "{}", 0, uint64_t{1} << 62));
    CHECK(contains(text, "raw.safetensors' has a header length of 4611686018427387904 bytes, which does not fit"));
    CHECK(contains(openError(writeRaw(dir, "{}", 0, 3)), "header length of 3 bytes, which does not fit the file (10"));
  }
  SECTION("a header that is not JSON, or not an object") {
    CHECK(contains(openError(writeRaw(dir, "{\"a\": ", 0)), "raw.safetensors' is not valid JSON"));
    CHECK(contains(openError(writeRaw(dir, "[1, 2]", 0)), "raw.safetensors' is not a JSON object"));
    CHECK(contains(openError(writeRaw(dir, R"({"a": {"dtype": "F32", "shape": [1]}})", 4)),
                   "raw.safetensors' is malformed at 'a'"));
  }
  SECTION("offsets outside the data area") {
    const auto text = openError(writeRaw(dir, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12));
    CHECK(contains(text, "tensor 'w' in '"));
    CHECK(contains(text, "(F32 [4]) has byte range [0, 16) that does not match its shape or lies outside the "
                         "file's 12 data bytes"));
    // A range of the shape's length that starts too late.
    CHECK(contains(openError(writeRaw(dir, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", 12)),
                   "(F32 [2]) has byte range [8, 16) that does not match its shape or lies outside"));
    CHECK(contains(openError(writeRaw(dir, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 4)),
                   "tensor 'w'"));
  }
  SECTION("a shape whose byte length is not the range's") {
    CHECK(contains(openError(writeRaw(dir, R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})", 8)),
                   "(BF16 [3]) has byte range [0, 8) that does not match"));
    CHECK(contains(openError(writeRaw(dir, R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4)),
                   "tensor 'w'"));
    // A product that overflows int64 is wrong, not wrapped round to the range's length.
    CHECK(contains(openError(writeRaw(
                       dir, R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0)),
                   "tensor 'w'"));
  }
  SECTION("an unknown dtype names the tensor") {
    CHECK(contains(openError(writeRaw(dir, R"({"q": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}})", 1)),
                   "tensor 'q' in '" + dir / "raw.safetensors" +
                       "' has dtype 'F8_E4M3', which zeroshard does not read"));
  }
  SECTION("a missing file, or a directory") {
    CHECK(contains(openError(dir / "none.safetensors"), "cannot open '" + dir / "none.safetensors" + "'"));
    CHECK(contains(openError(dir.path().string()), "not a regular file"));
  }
}

TEST_CASE("element ranges read straight from the file convert every float dtype to fp32", "[safetensors_file]") {
  TempDir dir;
  // Values every dtype holds exactly, and an fp64 value fp32 must round.
  const at::Tensor values = at::arange(-40, 40, at::kDouble).mul(0.375).view({8, 10});
  const at::Tensor fine = at::full({3}, 1.0 + 1e-12, at::kDouble);
  // Big enough that a bf16 read is converted in several pieces of kConvertChunkBytes.
  const int64_t bigNumel = SafetensorsFile::kConvertChunkBytes / 2 * 2 + 7;
  const at::Tensor big = at::arange(bigNumel, at::kFloat).remainder(251).sub(125).to(at::kBFloat16);
  const std::vector<TensorEntry> entries{{"f32", at::kFloat, {8, 10}}, {"bf16", at::kBFloat16, {8, 10}},
                                         {"f16", at::kHalf, {8, 10}},  {"f64", at::kDouble, {8, 10}},
                                         {"fine", at::kDouble, {3}},   {"count", at::kLong, {2}},
                                         {"big", at::kBFloat16, {bigNumel}}};
  {
    SafetensorsWriter writer(dir / "m.safetensors", entries, {{"format", "pt"}});
    writer.write(values.to(at::kFloat));
    writer.write(values.to(at::kBFloat16));
    writer.write(values.to(at::kHalf));
    writer.write(values);
    writer.write(fine);
    writer.write(at::arange(2, at::kLong).add(7));
    writer.write(big);
    writer.finish("m.safetensors");
  }
  SafetensorsFile file(dir / "m.safetensors");
  CHECK(file.header().metadata.at("format") == "pt");
  CHECK(file.headerBytesRead() == file.header().dataStart);
  CHECK(file.dataBytesRead() == 0);
  CHECK(file.find("none") == nullptr);

  int64_t expectedBytes = 0;
  for (const char* name : {"f32", "bf16", "f16", "f64"}) {
    const TensorEntry& e = *file.find(name);
    std::vector<float> out(23, -1.0f);
    file.readFloat(e, 31, 23, out.data());
    expectedBytes += 23 * static_cast<int64_t>(c10::elementSize(e.dtype));
    CHECK(file.dataBytesRead() == expectedBytes);
    CHECK(at::equal(at::from_blob(out.data(), {23}, at::kFloat), values.flatten().narrow(0, 31, 23).to(at::kFloat)));
  }
  float rounded[3];
  file.readFloat(*file.find("fine"), 0, 3, rounded);
  CHECK(rounded[2] == static_cast<float>(1.0 + 1e-12));

  std::vector<float> bigOut(static_cast<size_t>(bigNumel - 5));
  const int64_t before = file.dataBytesRead();
  file.readFloat(*file.find("big"), 5, bigNumel - 5, bigOut.data());
  CHECK(file.dataBytesRead() - before == (bigNumel - 5) * 2);
  CHECK(at::equal(at::from_blob(bigOut.data(), {bigNumel - 5}, at::kFloat),
                  big.narrow(0, 5, bigNumel - 5).to(at::kFloat)));

  // Whole tensors in their own dtype (module state: an integer buffer as it is).
  CHECK(at::equal(file.read(*file.find("count")), at::arange(2, at::kLong).add(7)));
  CHECK(contains(errorText([&] { file.readFloat(*file.find("count"), 0, 1, rounded); }),
                 "tensor 'count' in '" + dir / "m.safetensors" + "' is Long, not floating-point"));
  CHECK(contains(errorText([&] { file.readFloat(*file.find("fine"), 2, 2, rounded); }),
                 "elements [2, 4) of 'fine'"));
}

TEST_CASE("a file truncated after its header was checked fails the read naming the range", "[safetensors_file]") {
  TempDir dir;
  {
    SafetensorsWriter writer(dir / "m.safetensors", {TensorEntry{"w", at::kFloat, {64}}});
    writer.write(at::ones({64}, at::kFloat));
    writer.finish("m.safetensors");
  }
  SafetensorsFile file(dir / "m.safetensors");
  std::filesystem::resize_file(dir / "m.safetensors", file.header().dataStart + 100);
  std::vector<float> out(64);
  const auto text = errorText([&] { file.readFloat(*file.find("w"), 0, 64, out.data()); });
  CHECK(contains(text, "reading bytes ["));
  CHECK(contains(text, "m.safetensors' failed after 100: the file ended"));
}
