// The engine end to end, with real ranks (Gloo on loopback): each test starts
// zeroshard_engine_worker (tests/cpp/engine_worker.cpp) or the C++ training example once per
// rank and bounds them with a deadline.
#include "catch.h"

#include "spawn_ranks.h"

#include <cstdio>
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

TEST_CASE("engine.step() before any backward is an error that says to call backward", "[engine]") {
  auto outcomes = runScenario("step_before_backward", 2);
  for (const auto& o : outcomes) CHECK(o.output.find("expected error") != std::string::npos);
}

TEST_CASE("a train_batch_size the world size cannot produce is a ConfigError naming both numbers", "[engine]") {
  auto outcomes = runScenario("batch_size_mismatch", 2);
  for (const auto& o : outcomes) CHECK(o.output.find("expected error") != std::string::npos);
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
#endif
