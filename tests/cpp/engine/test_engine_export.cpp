// Engine::save16bitModel from C++ (csrc/zeroshard/checkpoint/streamed_export.cpp), over the one-rank Gloo
// group in this process; 2 ranks, every stage and the formats' readers: tests/python/test_save_16bit.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

#undef CHECK
#include "catch.h"

#include "single_rank_group.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/engine.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using zeroshard::Config;
using zeroshard::Engine;
using zeroshard::ModelExportStats;
using zeroshard::testing::TempDir;
using zeroshard::testing::singleRankGroup;

namespace {

// Keeps what TORCH_WARN says during its lifetime (on this thread).
class Warnings final : public c10::WarningHandler {
 public:
  Warnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

// blocks.0.w [60], blocks.1.w [40] and head [40] (also under "head_tied"), a buffer "scale";
// at stage 3 one unit each, the head in the root. At one rank the units are 64, 48 and 48
// elements padded.
struct Net {
  std::vector<std::pair<std::string, at::Tensor>> params;
  at::Tensor scale = at::full({2}, 0.5, at::kFloat);
  std::vector<std::pair<std::string, at::Tensor>> initial;  // the values before the engine took them

  Net() {
    for (const auto& [name, n] : std::vector<std::pair<std::string, int64_t>>{{"blocks.0.w", 60}, {"blocks.1.w", 40},
                                                                             {"head", 40}}) {
      at::Tensor p = at::arange(n, at::kFloat).mul(0.01).add(static_cast<double>(params.size())).set_requires_grad(true);
      params.emplace_back(name, p);
      initial.emplace_back(name, p.detach().clone());
    }
  }
};

std::unique_ptr<Engine> makeEngine(Net& net, int stage, bool gather, bool bf16) {
  Config config = Config::fromJsonString(
      R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": )" + std::to_string(stage) +
      R"(, "stage3_param_persistence_threshold": 0}, "zeroshard": {"collective_timeout_seconds": 30}})");
  config.zero.gather16bitWeightsOnModelSave = gather;
  config.bf16.enabled = bf16;
  zeroshard::ParamGroupSpec group;
  for (const auto& [name, p] : net.params) {
    group.names.push_back(name);
    group.params.push_back(p);
  }
  std::vector<zeroshard::UnitSpec> units;
  if (stage == 3) {
    units = {{"blocks.0", {"blocks.0.w"}, false}, {"blocks.1", {"blocks.1.w"}, false}, {"<root>", {"head"}, true}};
  }
  auto engine = std::make_unique<Engine>(std::vector<zeroshard::ParamGroupSpec>{group}, singleRankGroup(),
                                         std::move(config), std::move(units));
  auto state = net.params;
  state.emplace_back("head_tied", net.params[2].second);
  state.emplace_back("scale", net.scale);
  engine->setModuleStateFrom(state);
  return engine;
}

std::vector<char> bytesOf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

zeroshard::FileDigest digestOf(const std::string& path) {
  const auto bytes = bytesOf(path);
  zeroshard::FileDigest d;
  d.bytes = static_cast<int64_t>(bytes.size());
  d.chunkBytes = zeroshard::kChecksumChunkBytes;
  for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(d.chunkBytes)) {
    d.chunkCrcs.push_back(
        zeroshard::crc32Update(0, bytes.data() + at, std::min(bytes.size() - at, static_cast<size_t>(d.chunkBytes))));
  }
  return d;
}

} // namespace

TEST_CASE("stage 3 without the gather flag warns and writes nothing", "[engine_export]") {
  TempDir dir;
  Net net;
  auto engine = makeEngine(net, 3, /*gather=*/false, /*bf16=*/false);
  Warnings warnings;
  CHECK_FALSE(engine->save16bitModel((dir.path() / "out").string()));
  REQUIRE(warnings.messages.size() == 1);
  CHECK(warnings.messages[0].find("stage3_gather_16bit_weights_on_model_save") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.path() / "out"));
}

TEST_CASE("stage 3 writes the state dict in bf16 gathering one unit at a time and releases it again",
          "[engine_export]") {
  TempDir dir;
  Net net;
  auto engine = makeEngine(net, 3, /*gather=*/true, /*bf16=*/true);
  const int64_t heldBytes = engine->memoryStats().paramBytes;
  ModelExportStats stats;
  Warnings warnings;
  REQUIRE(engine->save16bitModel(dir.path().string(), "model.safetensors", {}, &stats));
  CHECK(warnings.messages.empty());
  CHECK(stats.tensors == 4);  // three parameters (the tied head once) and the buffer
  CHECK(stats.gatheredPeakBytes == 64 * 2);  // blocks.0 alone, in bf16
  // Every unit is released again: the parameters hold no storage, the shards are all there is.
  for (const auto& [name, p] : net.params) CHECK(p.storage().nbytes() == 0);
  CHECK(engine->memoryStats().paramBytes == heldBytes);

  const std::string path = (dir.path() / "model.safetensors").string();
  CHECK(stats.fileBytes == static_cast<int64_t>(std::filesystem::file_size(path)));
  zeroshard::SafetensorsReader reader(path, digestOf(path));
  for (const auto& [name, value] : net.initial) CHECK(at::equal(reader.read(name), value.to(at::kBFloat16)));
  CHECK(at::equal(reader.read("scale"), net.scale));
  CHECK_FALSE(reader.contains("head_tied"));
  std::vector<std::string> left;  // no partial file beside it
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) left.push_back(entry.path().filename());
  CHECK(left == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("stage 0 writes a torch file with every name, the tied one included", "[engine_export]") {
  TempDir dir;
  Net net;
  auto engine = makeEngine(net, 0, /*gather=*/false, /*bf16=*/false);
  ModelExportStats stats;
  REQUIRE(engine->save16bitModel(dir.path().string(), "pytorch_model.bin", {}, &stats));
  CHECK(stats.gatheredPeakBytes == 0);
  const auto loaded = torch::jit::pickle_load(bytesOf((dir.path() / "pytorch_model.bin").string())).toGenericDict();
  std::vector<std::string> keys;
  for (const auto& item : loaded) keys.push_back(item.key().toStringRef());
  CHECK(keys == std::vector<std::string>{"blocks.0.w", "blocks.1.w", "head", "head_tied", "scale"});
  for (const auto& [name, value] : net.initial) CHECK(at::equal(loaded.at(name).toTensor(), value));
  CHECK(at::equal(loaded.at("head_tied").toTensor(), net.initial[2].second));
  CHECK(at::equal(loaded.at("scale").toTensor(), net.scale));
}

TEST_CASE("the consolidated state dict at stage 3, without the gather flag, holds every name whole on CPU",
          "[engine_export]") {
  Net net;
  auto engine = makeEngine(net, 3, /*gather=*/false, /*bf16=*/true);
  const int64_t heldBytes = engine->memoryStats().paramBytes;
  ModelExportStats stats;
  Warnings warnings;
  const auto state = engine->consolidatedStateDict({}, &stats);
  CHECK(warnings.messages.empty());
  REQUIRE(state.has_value());  // rank 0 of one
  std::vector<std::string> names;
  for (const auto& [name, value] : *state) names.push_back(name);
  CHECK(names == std::vector<std::string>{"blocks.0.w", "blocks.1.w", "head", "head_tied", "scale"});
  for (size_t i = 0; i < net.initial.size(); ++i) {
    CHECK((*state)[i].second.device().is_cpu());
    CHECK(at::equal((*state)[i].second, net.initial[i].second.to(at::kBFloat16)));
  }
  // The tied name is the same tensor; the buffer a copy, not the engine's own.
  CHECK((*state)[3].second.is_same((*state)[2].second));
  CHECK(at::equal((*state)[4].second, net.scale));
  CHECK_FALSE((*state)[4].second.is_same(net.scale));
  CHECK(stats.tensors == 4);
  CHECK(stats.gatheredPeakBytes == 64 * 2);  // blocks.0 alone, in bf16
  for (const auto& [name, p] : net.params) CHECK(p.storage().nbytes() == 0);  // every unit released
  CHECK(engine->memoryStats().paramBytes == heldBytes);
}

TEST_CASE("the consolidated state dict leaves out what it is told to, and below stage 3 gathers nothing",
          "[engine_export]") {
  Net net;
  auto engine = makeEngine(net, 1, /*gather=*/false, /*bf16=*/false);
  ModelExportStats stats;
  const auto state = engine->consolidatedStateDict({{"blocks.1.w", "scale"}}, &stats);
  REQUIRE(state.has_value());
  std::vector<std::string> names;
  for (const auto& [name, value] : *state) names.push_back(name);
  CHECK(names == std::vector<std::string>{"blocks.0.w", "head", "head_tied"});
  CHECK(at::equal((*state)[0].second, net.initial[0].second));
  CHECK(stats.gatheredPeakBytes == 0);
  CHECK_THROWS_WITH(engine->consolidatedStateDict({{"nope"}}),
                    Catch::Contains("consolidated_state_dict: cannot exclude 'nope'"));
}
