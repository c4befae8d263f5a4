// The engine's accumulation boundary from C++ (Engine::setAccumulationBoundary, backward's
// scaleByAccumulation; Note [accumulation boundary] in csrc/zeroshard/optim/accumulation_window.h),
// over the one-rank Gloo group in this process. 2 ranks and the Python layers:
// tests/python/test_accumulation_boundary.py.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "single_rank_group.h"
#include "temp_dir.h"
#include "zeroshard/engine.h"

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using zeroshard::Config;
using zeroshard::Engine;
using zeroshard::testing::TempDir;
using zeroshard::testing::singleRankGroup;

namespace {

constexpr int64_t kNumel = 12;

// A fresh weight (the same values each time) and an engine over it. AdamW's update hardly
// depends on the gradients' scale; a large eps makes it do so, so that a loss scaled wrongly
// shows in the weights.
struct Trained {
  at::Tensor weight;
  std::unique_ptr<Engine> engine;
  std::vector<std::string> lines;  // the log lines
};

std::unique_ptr<Trained> makeEngine(int stage, int64_t gas) {
  auto t = std::make_unique<Trained>();
  t->weight = at::arange(kNumel, at::kFloat).mul(0.1).sub(0.5).set_requires_grad(true);
  zeroshard::ParamGroupSpec group;
  group.names = {"w"};
  group.params = {t->weight};
  t->engine = std::make_unique<Engine>(
      std::vector<zeroshard::ParamGroupSpec>{group}, singleRankGroup(),
      Config::fromJsonString(R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": )" +
                             std::to_string(gas) + R"(, "steps_per_print": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01, "eps": 0.5}},
          "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0},
          "zeroshard": {"collective_timeout_seconds": 30}})"));
  Trained* raw = t.get();
  t->engine->setLogSink([raw](const std::string& line) { raw->lines.push_back(line); });
  return t;
}

// Micro-step m's loss: a different quadratic each time.
at::Tensor lossOf(const at::Tensor& weight, int64_t m) {
  const at::Tensor target = at::arange(kNumel, at::kFloat).mul(0.05 * static_cast<double>(m % 5 + 1));
  return (weight - target).square().mul(static_cast<double>(m % 3 + 1)).sum();
}

// Micro-steps [first, first + count)'s mean loss, run as the engine runs a model (stage 3: the
// parameter is gathered for the forward, and again for the backward).
at::Tensor meanLoss(Trained& t, int64_t first, int64_t count = 1) {
  return t.engine->runUnit(0, [&] {
    at::Tensor sum = lossOf(t.weight, first);
    for (int64_t m = first + 1; m < first + count; ++m) sum = sum + lossOf(t.weight, m);
    return count > 1 ? sum / static_cast<double>(count) : sum;
  });
}

at::Tensor master(Engine& engine) {
  return engine.masterWeights().at(0).second;
}

} // namespace

TEST_CASE("windows forced as 4, 2 and 4 train like one step per window on each window's mean loss",
          "[engine][accumulation]") {
  const std::vector<int64_t> windows = {4, 2, 4};
  for (const int stage : {0, 1, 2, 3}) {
    INFO("stage " << stage);
    auto forced = makeEngine(stage, 4);
    auto reference = makeEngine(stage, 1);
    int64_t m = 0;
    std::vector<bool> stepped;
    for (const int64_t length : windows) {
      reference->engine->backward(meanLoss(*reference, m, length));
      REQUIRE(reference->engine->step());
      for (int64_t i = 0; i < length; ++i, ++m) {
        // The Trainer's pattern: the boundary set before every backward, true at the window's end.
        forced->engine->setAccumulationBoundary(i == length - 1);
        forced->engine->backward(meanLoss(*forced, m) / static_cast<double>(length), /*scaleByAccumulation=*/false);
        stepped.push_back(forced->engine->step());
      }
    }
    CHECK(stepped == std::vector<bool>{false, false, false, true, false, true, false, false, false, true});
    CHECK(forced->engine->globalSteps() == 3);
    CHECK(forced->engine->accumulationBoundaries() == 3);
    CHECK(forced->engine->microSteps() == 10);
    CHECK(at::allclose(master(*forced->engine), master(*reference->engine), 1e-6, 1e-7));
    REQUIRE(forced->lines.size() == 3);  // steps_per_print 1: one line per window
    CHECK(forced->lines.back().rfind("step=3,", 0) == 0);

    // Saved after the short window's run (between windows), under the step count; loaded into a
    // fresh engine, which has the same weights and counts the same.
    TempDir dir;
    const std::string path = forced->engine->saveCheckpoint(dir.path().string());
    CHECK(std::filesystem::path(path).filename() == "global_step3");
    auto resumed = makeEngine(stage, 4);
    resumed->engine->loadCheckpoint(dir.path().string());
    CHECK(resumed->engine->accumulationBoundaries() == 3);
    CHECK(resumed->engine->microSteps() == 12);  // 3 windows of 4, as a load always counts them
    CHECK(resumed->engine->globalSteps() == 3);
    CHECK(at::equal(master(*resumed->engine), master(*forced->engine)));
  }
}

TEST_CASE("a checkpoint right after a forced short window saves and loads", "[engine][accumulation]") {
  auto engine = makeEngine(2, 4);
  for (int64_t m = 0; m < 6; ++m) {  // 4 counted, then a window of 2 ended by hand
    if (m == 5) engine->engine->setAccumulationBoundary(true);
    engine->engine->backward(meanLoss(*engine, m));
    engine->engine->step();
  }
  engine->engine->setAccumulationBoundary(std::nullopt);
  CHECK(engine->engine->accumulationBoundaries() == 2);
  TempDir dir;
  CHECK(std::filesystem::path(engine->engine->saveCheckpoint(dir.path().string())).filename() == "global_step2");
  auto resumed = makeEngine(2, 4);
  resumed->engine->loadCheckpoint(dir.path().string());
  CHECK(at::equal(master(*resumed->engine), master(*engine->engine)));
  // Both go on alike: a whole window of 4 next.
  for (auto* t : {engine.get(), resumed.get()}) {
    for (int64_t m = 6; m < 10; ++m) {
      t->engine->backward(meanLoss(*t, m));
      CHECK(t->engine->step() == (m == 9));
    }
  }
  CHECK(at::equal(master(*resumed->engine), master(*engine->engine)));
}

TEST_CASE("a forced false at the natural boundary keeps accumulating; checkpoints wait for the boundary",
          "[engine][accumulation]") {
  auto engine = makeEngine(1, 2);
  const at::Tensor start = master(*engine->engine);
  engine->engine->setAccumulationBoundary(false);
  for (int64_t m = 0; m < 3; ++m) {
    CHECK_FALSE(engine->engine->isAccumulationBoundary());
    engine->engine->backward(meanLoss(*engine, m));
    CHECK_FALSE(engine->engine->step());
  }
  CHECK(at::equal(master(*engine->engine), start));  // nothing stepped
  CHECK(engine->engine->globalSteps() == 0);
  TempDir dir;
  CHECK_THROWS_WITH(engine->engine->saveCheckpoint(dir.path().string()),
                    Catch::Contains("must be called between optimizer steps"));
  engine->engine->setAccumulationBoundary(std::nullopt);
  CHECK(engine->engine->isAccumulationBoundary());  // 3 micro-steps in a window of 2: ends at the next
  engine->engine->backward(meanLoss(*engine, 3));
  CHECK(engine->engine->step());
  CHECK(engine->engine->globalSteps() == 1);
  CHECK(engine->engine->microSteps() == 4);
}

TEST_CASE("the step follows its backward's decision even when the boundary is set in between",
          "[engine][accumulation]") {
  auto engine = makeEngine(2, 4);
  engine->engine->backward(meanLoss(*engine, 0));
  engine->engine->setAccumulationBoundary(true);
  CHECK_FALSE(engine->engine->isAccumulationBoundary());  // the backward decided: 1 of 4
  CHECK_FALSE(engine->engine->step());
  CHECK(engine->engine->isAccumulationBoundary());
  engine->engine->backward(meanLoss(*engine, 1));
  CHECK(engine->engine->step());
  CHECK(engine->engine->globalSteps() == 1);
}

TEST_CASE("backward without scaling by the accumulation steps equals backward of loss / steps bitwise",
          "[engine][accumulation]") {
  for (const int stage : {0, 2, 3}) {
    INFO("stage " << stage);
    auto scaled = makeEngine(stage, 4);
    auto unscaled = makeEngine(stage, 4);
    for (int64_t m = 0; m < 8; ++m) {
      scaled->engine->backward(meanLoss(*scaled, m));
      unscaled->engine->backward(meanLoss(*unscaled, m) / 4.0, /*scaleByAccumulation=*/false);
      CHECK(scaled->engine->step() == unscaled->engine->step());
    }
    CHECK(scaled->engine->globalSteps() == 2);
    CHECK(at::equal(master(*scaled->engine), master(*unscaled->engine)));
  }
}
