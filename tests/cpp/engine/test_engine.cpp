// The engine end to end, with real ranks (Gloo on loopback): each test starts
// zeroshard_engine_worker (tests/cpp/engine_worker.cpp) or the C++ training example once per
// rank and bounds them with a deadline.
#include "catch.h"

#include "spawn_ranks.h"
#include "temp_dir.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using zeroshard::testing::describeFailures;
using zeroshard::testing::spawnRanks;

namespace {

// Runs one worker scenario at `world` ranks and requires every rank to exit 0.
std::vector<zeroshard::testing::RankOutcome> runScenario(const char* scenario, int world) {
  auto outcomes = spawnRanks(ZEROSHARD_ENGINE_WORKER, scenario, world);
  INFO(scenario << " at " << world << " ranks\n" << describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());
  return outcomes;
}

} // namespace

TEST_CASE("stage 2 at 2 ranks matches single-process torch::optim::AdamW", "[engine]") {
  auto outcomes = runScenario("stage2_parity", 2);
  CHECK(outcomes[0].output.find("parameters match torch::optim::AdamW") != std::string::npos);
}

TEST_CASE("stage 2 at 2 ranks holds the fp32 memory formula and moves 2x the padded parameters per step",
          "[engine]") {
  runScenario("stage2_accounting", 2);
}

TEST_CASE("Engine::stage3Units lists the named units and the root with their persistent parameters", "[engine]") {
  auto outcomes = runScenario("stage3_units", 2);
  CHECK(outcomes[0].output.find("stage 3 units as built") != std::string::npos);
}

TEST_CASE("from C++, offload_optimizer cpu trains bitwise like the plain engine with its state in host memory",
          "[engine][offload]") {
  auto outcomes = runScenario("stage2_offload", 2);
  CHECK(outcomes[0].output.find("offloaded run is bitwise the plain one") != std::string::npos);
}

TEST_CASE("engine.step() before any backward is an error that says to call backward", "[engine]") {
  auto outcomes = runScenario("step_before_backward", 2);
  for (const auto& o : outcomes) CHECK(o.output.find("expected error") != std::string::npos);
}

TEST_CASE("a train_batch_size the world size cannot produce is a ConfigError naming both numbers", "[engine]") {
  auto outcomes = runScenario("batch_size_mismatch", 2);
  for (const auto& o : outcomes) CHECK(o.output.find("expected error") != std::string::npos);
}

TEST_CASE("from C++, a checkpoint saved at 2 ranks loads into a fresh engine that trains on identically",
          "[engine][checkpoint]") {
  zeroshard::testing::TempDir dir;
  const std::vector<std::string> args = {"checkpoint_resume", dir.path().string()};
  auto outcomes = spawnRanks(ZEROSHARD_ENGINE_WORKER, args, 2);
  INFO(describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());
  CHECK(outcomes[0].output.find("resumed run matches the uninterrupted one") != std::string::npos);
}

#ifdef ZEROSHARD_TRAIN_EXAMPLE
TEST_CASE("the C++ training example at 2 ranks lowers its loss with configs/zero2.json", "[engine][example]") {
  const std::vector<std::string> args = {"--steps", "30", "--config", ZEROSHARD_SOURCE_DIR "/configs/zero2.json"};
  auto outcomes = spawnRanks(ZEROSHARD_TRAIN_EXAMPLE, args, 2);
  INFO(describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());

  const std::string& log = outcomes[0].output;
  INFO("rank 0 output:\n" << log);
  const auto at = log.rfind("final loss ");
  REQUIRE(at != std::string::npos);
  double finalLoss = 0, firstLoss = 0;
  REQUIRE(std::sscanf(log.c_str() + at, "final loss %lf (first loss %lf)", &finalLoss, &firstLoss) == 2);
  CHECK(finalLoss < firstLoss);
  // Only rank 0 logs.
  CHECK(outcomes[1].output.find("final loss") == std::string::npos);
}

namespace {
// Runs the example at 2 ranks with a config given as JSON text; returns rank 0's final loss.
double exampleFinalLoss(const std::string& configJson, const std::string& expectStage) {
  char path[] = "/tmp/zeroshard-config-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  std::ofstream(path) << configJson;
  const std::vector<std::string> args = {"--steps", "20", "--config", path};
  auto outcomes = spawnRanks(ZEROSHARD_TRAIN_EXAMPLE, args, 2);
  std::remove(path);
  INFO(describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());
  const std::string& log = outcomes[0].output;
  INFO("rank 0 output:\n" << log);
  REQUIRE(log.find(expectStage) != std::string::npos);
  const auto at = log.rfind("final loss ");
  REQUIRE(at != std::string::npos);
  double finalLoss = 0, firstLoss = 0;
  REQUIRE(std::sscanf(log.c_str() + at, "final loss %lf (first loss %lf)", &finalLoss, &firstLoss) == 2);
  return finalLoss;
}
} // namespace

TEST_CASE("bf16 and fp16 configs train from C++ (16-bit parameters, fp32 master weights)", "[engine][example]") {
  for (const std::string precision : {"bf16", "fp16"}) {
    INFO(precision);
    const std::string config = R"({"train_micro_batch_size_per_gpu": 8, "optimizer": {"params": {"lr": 0.01}},
      ")" + precision + R"(": {"enabled": true}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "zeroshard": {"collective_timeout_seconds": 30}})";
    const double fp32 = exampleFinalLoss(R"({"train_micro_batch_size_per_gpu": 8, "optimizer": {"params": {"lr": 0.01}},
      "zero_optimization": {"stage": 3}, "zeroshard": {"collective_timeout_seconds": 30}})", "stage 3");
    const double half = exampleFinalLoss(config, "stage 3");
    // 16-bit training follows fp32 to within a few percent after 20 steps.
    CHECK(std::abs(half - fp32) <= 0.05 * fp32);
  }
}

TEST_CASE("stage 3 from C++ (every Linear a unit, run through runUnit) trains exactly like stage 2",
          "[engine][example][stage3]") {
  const std::string common = R"("train_micro_batch_size_per_gpu": 8, "optimizer": {"params": {"lr": 0.001}},
    "zeroshard": {"collective_timeout_seconds": 30})";
  const double stage2 = exampleFinalLoss("{" + common + R"(, "zero_optimization": {"stage": 2}})", "stage 2");
  const double stage3 = exampleFinalLoss(
      "{" + common + R"(, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})", "stage 3");
  // Printed with 6 decimals; the two stages differ only by rounding in the reductions.
  CHECK(std::abs(stage3 - stage2) <= 2e-6 + 1e-5 * std::abs(stage2));
}
#endif
