#include "catch.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>

#include "temp_dir.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/checkpoint/reader.h"
#include "zeroshard/checkpoint/safetensors.h"

#include <filesystem>
#include <fstream>
#include <string>

using namespace zeroshard;
using zeroshard::testing::TempDir;

namespace {

// The file descriptors this process holds.
size_t openFiles() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A checkpoint as `ranks` ranks would save one buffer of `ranks` x 16 elements holding one
// parameter "w" = 0, 1, 2, ... (exp_avg = w + 1000, exp_avg_sq = w + 2000).
void writeCheckpoint(const std::string& dir, int ranks) {
  constexpr int64_t kShard = 16;
  CheckpointManifest m;
  m.tag = "t";
  m.worldSize = ranks;
  m.configJson = "{}";
  m.groups = {AdamWHyper{}};
  m.buffers = {SavedBuffer{ranks * kShard, kShard}};
  m.params = {SavedParam{"w", {ranks * kShard}, 0, 0, 0}};
  std::filesystem::create_directories(dir);
  for (int r = 0; r < ranks; ++r) {
    std::vector<TensorEntry> entries;
    for (const char* kind : kStateKinds) {
      entries.push_back({CheckpointManifest::stateTensorName(0, kind), at::kFloat, {kShard}});
    }
    const std::string name = CheckpointManifest::rankFileName(r);
    SafetensorsWriter writer(dir + "/" + name, entries);
    for (int kind = 0; kind < 3; ++kind) {
      writer.write(at::arange(r * kShard, (r + 1) * kShard, at::TensorOptions().dtype(at::kFloat)).add(1000 * kind));
    }
    m.files.push_back(writer.finish(name));
  }
  std::ofstream(dir + "/" + kManifestFile) << m.toJsonText();
}

} // namespace

TEST_CASE("a parameter spread over many saved ranks reads back whole, with a bounded number of files open",
          "[checkpoint]") {
  TempDir dir;
  constexpr int kRanks = 12;
  writeCheckpoint(dir / "t", kRanks);
  const size_t before = openFiles();
  CheckpointReader reader(dir.path().string(), std::string("t"));
  const auto w = at::arange(kRanks * 16, at::TensorOptions().dtype(at::kFloat));
  for (int pass = 0; pass < 2; ++pass) {  // the second pass reopens files the first one closed
    CHECK(at::equal(reader.readParam("w"), w));
    at::Tensor expAvgSq = at::empty({w.numel()}, w.options());
    reader.readParam(*reader.findParam("w"), "exp_avg_sq", 0, w.numel(), expAvgSq.data_ptr<float>());
    CHECK(at::equal(expAvgSq, w.add(2000)));
  }
  // Every one of the 12 files was read, at most 8 stay open at once.
  CHECK(openFiles() - before <= 8);
}
