// Multi-process collectives with Gloo on loopback: each test starts real ranks through
// zeroshard_test_worker (tests/cpp/worker_main.cpp) and bounds them with a deadline.
#include "catch.h"

#include "error_text.h"
#include "spawn_ranks.h"
#include "zeroshard/comm/process_group.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <vector>

using zeroshard::testing::describeFailures;
using zeroshard::testing::spawnRanks;

TEST_CASE("collectives give the right values and byte counts at 2 and 4 ranks", "[communicator]") {
  for (int world : {2, 4}) {
    auto outcomes = spawnRanks(ZEROSHARD_TEST_WORKER, "collectives", world);
    INFO("world size " << world << "\n" << describeFailures(outcomes));
    CHECK(describeFailures(outcomes).empty());
  }
}

TEST_CASE("values and text of different lengths from every rank arrive whole and by rank", "[communicator]") {
  for (int world : {2, 3}) {
    auto outcomes = spawnRanks(ZEROSHARD_TEST_WORKER, "gather_values", world);
    INFO("world size " << world << "\n" << describeFailures(outcomes));
    CHECK(describeFailures(outcomes).empty());
  }
}

TEST_CASE("hybrid sharding's shard and replicate subgroups reduce and gather over their members only",
          "[communicator][hybrid]") {
  auto outcomes = spawnRanks(ZEROSHARD_TEST_WORKER, "subgroups", 4);
  INFO(describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());
}

TEST_CASE("hybridRanks splits the world into consecutive shard groups and strided replicate groups",
          "[communicator][hybrid]") {
  const auto r3 = zeroshard::hybridRanks(3, 4, 2);
  CHECK(r3.shard == std::vector<int>{2, 3});
  CHECK(r3.replicate == std::vector<int>{1, 3});
  const auto r5 = zeroshard::hybridRanks(5, 8, 4);
  CHECK(r5.shard == std::vector<int>{4, 5, 6, 7});
  CHECK(r5.replicate == std::vector<int>{1, 5});
  CHECK(zeroshard::hybridRanks(2, 4, 4).replicate == std::vector<int>{2});
  CHECK(zeroshard::hybridRanks(2, 4, 1).shard == std::vector<int>{2});
  CHECK(zeroshard::testing::contains(zeroshard::testing::errorText([] { zeroshard::hybridRanks(0, 6, 4); }),
                                     "a shard group of 4 ranks does not divide the world of 6 ranks"));
}

TEST_CASE("a dead peer makes the collective fail with its name instead of hanging", "[communicator]") {
  auto outcomes = spawnRanks(ZEROSHARD_TEST_WORKER, "dead_peer", 2);
  INFO(describeFailures(outcomes));
  REQUIRE(describeFailures(outcomes).empty());
  CHECK(outcomes[0].output.find("expected error") != std::string::npos);
}

TEST_CASE("a stalled peer makes the collective time out instead of hanging", "[communicator]") {
  zeroshard::testing::SpawnOptions options;
  options.lingeringRank = 1;
  auto outcomes = spawnRanks(ZEROSHARD_TEST_WORKER, "stalled_peer", 2, options);
  INFO(describeFailures(outcomes, 1));
  REQUIRE(describeFailures(outcomes, 1).empty());
  CHECK(outcomes[0].output.find("expected error") != std::string::npos);
}

namespace {
// Sets the torchrun variables for one test and restores the environment after it.
struct ScopedLaunchEnv {
  explicit ScopedLaunchEnv(const char* rank, const char* world, const char* addr, const char* port) {
    set("RANK", rank);
    set("WORLD_SIZE", world);
    set("MASTER_ADDR", addr);
    set("MASTER_PORT", port);
    ::unsetenv("LOCAL_RANK");
  }
  ~ScopedLaunchEnv() {
    for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  }
  static void set(const char* name, const char* value) {
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  }
};

std::string launchError() {
  try {
    zeroshard::readLaunchEnv();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}
} // namespace

TEST_CASE("the torchrun environment is read, and a bad one is named", "[process_group]") {
  {
    ScopedLaunchEnv env("1", "4", "127.0.0.1", "29500");
    auto launch = zeroshard::readLaunchEnv();
    CHECK(launch.rank == 1);
    CHECK(launch.worldSize == 4);
    CHECK(launch.localRank == 1);
    CHECK(launch.masterAddr == "127.0.0.1");
    CHECK(launch.masterPort == 29500);
  }
  {
    ScopedLaunchEnv env("0", nullptr, "127.0.0.1", "29500");
    CHECK(launchError().find("WORLD_SIZE is not set") != std::string::npos);
  }
  {
    ScopedLaunchEnv env("4", "4", "127.0.0.1", "29500");
    CHECK(launchError().find("RANK=4 is out of range [0, 3]") != std::string::npos);
  }
  {
    ScopedLaunchEnv env("0", "2", "127.0.0.1", "http");
    CHECK(launchError().find("MASTER_PORT=\"http\" is not an integer") != std::string::npos);
  }
}

TEST_CASE("one GPU per local rank when every local rank has one, else CPU tensors and Gloo with a reason",
          "[process_group]") {
  const auto none = zeroshard::chooseDevice(1, 2, 0);
  CHECK((!none.useGpu && none.gpu == -1 && none.warning.empty()));

  for (int local = 0; local < 4; ++local) {
    const auto enough = zeroshard::chooseDevice(local, 4, 4);
    CHECK((enough.useGpu && enough.gpu == local && enough.warning.empty()));
  }
  const auto spare = zeroshard::chooseDevice(1, 2, 8);
  CHECK((spare.useGpu && spare.gpu == 1));

  const auto tooFew = zeroshard::chooseDevice(2, 4, 2);
  CHECK((!tooFew.useGpu && tooFew.gpu == -1));
  CHECK(tooFew.warning.find("4 ranks on this machine but 2 visible GPU(s)") != std::string::npos);
}
