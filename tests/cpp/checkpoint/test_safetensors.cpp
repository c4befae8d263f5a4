#include "catch.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/safetensors.h"

#include <fstream>
#include <string>

using zeroshard::SafetensorsReader;
using zeroshard::SafetensorsWriter;
using zeroshard::TensorEntry;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

TEST_CASE("safetensors written as a stream read back whole and in slices", "[safetensors]") {
  TempDir dir;
  const at::Tensor a = at::arange(12, at::TensorOptions().dtype(at::kFloat)).view({3, 4});
  const at::Tensor b = at::arange(5, at::TensorOptions().dtype(at::kBFloat16));
  const at::Tensor empty = at::arange(0, at::TensorOptions().dtype(at::kLong));
  SafetensorsWriter writer(dir / "t.safetensors",
                           {TensorEntry{"a", at::kFloat, {3, 4}}, TensorEntry{"empty", at::kLong, {0}},
                            TensorEntry{"b", at::kBFloat16, {5}}},
                           {{"format", "pt"}});
  writer.write(a);
  writer.write(empty);
  writer.write(b);
  const auto digest = writer.finish("t.safetensors");

  // The header length is 8 bytes little-endian, and the header is padded so data starts aligned.
  std::ifstream raw(dir / "t.safetensors", std::ios::binary);
  unsigned char prefix[8];
  raw.read(reinterpret_cast<char*>(prefix), 8);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(prefix[i]) << (8 * i);
  CHECK(length % 8 == 0);
  CHECK(static_cast<int64_t>(8 + length + 12 * 4 + 5 * 2) == digest.bytes);

  SafetensorsReader reader(dir / "t.safetensors", digest);
  CHECK(reader.metadata().at("format") == "pt");
  CHECK(at::equal(reader.read("a"), a));
  CHECK(at::equal(reader.read("b"), b));
  CHECK(reader.read("empty").numel() == 0);
  float slice[3];
  reader.readElements("a", 5, 3, slice);
  CHECK((slice[0] == 5 && slice[1] == 6 && slice[2] == 7));
  CHECK(contains(errorText([&] { reader.entry("c"); }), "tensor 'c' is not in"));
}

TEST_CASE("a tensor that does not match its header entry is refused", "[safetensors]") {
  TempDir dir;
  SafetensorsWriter writer(dir / "t.safetensors", {TensorEntry{"a", at::kFloat, {4}}});
  CHECK(contains(errorText([&] { writer.write(at::arange(5, at::TensorOptions().dtype(at::kFloat))); }),
                 "tensor 'a' is Float with 5 elements, the header says Float with 4"));
}
