// Checkpoints on a clock and the batch guard from C++ (csrc/zeroshard/engine/engine.cpp,
// checkpoint/checkpoint_clock.cpp, checkpoint/engine_checkpoint_load.cpp), over the one-rank Gloo group
// in this process; at 2 ranks
// (rank 0's clock deciding for both) and through Python: tests/python/test_clock_and_batch.py.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "single_rank_group.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/engine.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

using zeroshard::Config;
using zeroshard::Engine;
using zeroshard::testing::TempDir;
using zeroshard::testing::singleRankGroup;

namespace {

std::unique_ptr<Engine> makeEngine(at::Tensor& weight, const std::string& zeroshardKeys) {
  weight = at::arange(12, at::kFloat).mul(0.1).set_requires_grad(true);
  zeroshard::ParamGroupSpec group;
  group.names = {"w"};
  group.params = {weight};
  return std::make_unique<Engine>(
      std::vector<zeroshard::ParamGroupSpec>{group}, singleRankGroup(),
      Config::fromJsonString(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                 "zeroshard": {"collective_timeout_seconds": 30, )" + zeroshardKeys + "}}"));
}

void trainStep(Engine& engine, const at::Tensor& weight) {
  engine.backward(weight.square().sum());
  engine.step();
}

std::vector<std::string> checkpointsIn(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  if (!std::filesystem::exists(dir)) return names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind(".staging", 0) != 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

} // namespace

TEST_CASE("step() saves at the first boundary every_minutes after the last save, keeping keep_last",
          "[engine_clock]") {
  TempDir dir;
  at::Tensor weight;
  auto engine = makeEngine(weight, R"("checkpoint": {"every_minutes": 30, "keep_last": 2, "dir": ")" +
                                       (dir.path() / "ckpt").string() + R"("})");
  double now = 100;  // minutes, any origin: the clock counts from when it is set
  engine->setClock([&now] { return now; });
  // Before each step, the clock reads: due at 131 (31 after 100), then 162, then 195.
  const std::vector<double> times = {110, 120, 131, 140, 162, 170, 195};
  const std::vector<std::vector<std::string>> expected = {
      {}, {}, {"global_step3"}, {"global_step3"}, {"global_step3", "global_step5"}, {"global_step3", "global_step5"},
      {"global_step5", "global_step7"}};
  for (size_t i = 0; i < times.size(); ++i) {
    now = times[i];
    trainStep(*engine, weight);
    INFO("step " << i + 1);
    CHECK(checkpointsIn(dir.path() / "ckpt") == expected[i]);
  }
  // A save by hand restarts the clock, and setClockSaves(false) leaves the saving to the caller.
  now = 300;
  engine->saveCheckpoint((dir.path() / "ckpt").string(), "by_hand");
  now = 329;
  CHECK_FALSE(engine->checkpointDue());
  now = 330;
  CHECK(engine->checkpointDue());
  engine->setClockSaves(false);
  trainStep(*engine, weight);
  // Nothing new; keep_last counts the default tags only, so both stay beside the one by hand.
  CHECK(checkpointsIn(dir.path() / "ckpt") == std::vector<std::string>{"by_hand", "global_step5", "global_step7"});
}

TEST_CASE("without every_minutes nothing is ever due", "[engine_clock]") {
  at::Tensor weight;
  auto engine = makeEngine(weight, R"("checkpoint": {"keep_last": 2})");
  double now = 0;
  engine->setClock([&now] { return now; });
  now = 1e9;
  CHECK_FALSE(engine->checkpointDue());
}

TEST_CASE("every_minutes needs a directory, and batch_guard is warn or error", "[engine_clock]") {
  CHECK_THROWS_WITH(Config::fromJsonString(R"({"zeroshard": {"checkpoint": {"every_minutes": 30}}})"),
                    Catch::Contains("zeroshard.checkpoint.dir, the directory to save into"));
  CHECK_THROWS_WITH(Config::fromJsonString(R"({"zeroshard": {"batch_guard": "ignore"}})"),
                    Catch::Contains("zeroshard.batch_guard: must be \"warn\" or \"error\""));
}

TEST_CASE("the batch guard names the old and new batch and the accumulation that keeps the old one",
          "[engine_clock]") {
  zeroshard::CheckpointManifest m;
  m.tag = "global_step9";
  CHECK_FALSE(zeroshard::batchChange(m, {8, 2, 2}, 2));  // an older checkpoint: nothing recorded
  m.batch = zeroshard::SavedBatch{16, 2, 2, 4};
  CHECK_FALSE(zeroshard::batchChange(m, {16, 2, 4}, 2));  // the same global batch, another layout
  const auto fewer = zeroshard::batchChange(m, {8, 2, 2}, 2);
  REQUIRE(fewer);
  CHECK(*fewer == "zeroshard checkpoint 'global_step9': saved with a global batch of 16 (2 per rank x 2 "
                  "accumulation steps x 4 ranks), resumed with 8 (2 per rank x 2 accumulation steps x 2 ranks): "
                  "the run goes on with another batch (and so another effective learning rate); "
                  "gradient_accumulation_steps 4 keeps the global batch of 16");
  const auto none = zeroshard::batchChange(m, {9, 3, 1}, 3);
  REQUIRE(none);
  CHECK(none->find("no gradient_accumulation_steps keeps 16 at 3 per rank on 3 ranks (16 is not a multiple of 9)") !=
        std::string::npos);
}
