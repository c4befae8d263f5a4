// Multi-process collectives with Gloo on loopback: each test starts real ranks through
// zeroshard_test_worker (tests/cpp/worker_main.cpp) and bounds them with a deadline.
#include "catch.h"

#include "error_text.h"
#include "spawn_ranks.h"
#include "zeroshard/comm/process_group.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
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
    for (const char* name : kNodeVars) ::unsetenv(name);
  }
  ~ScopedLaunchEnv() {
    for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
    for (const char* name : kNodeVars) ::unsetenv(name);
  }
  static constexpr const char* kNodeVars[] = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"};
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

TEST_CASE("several nodes: torchrun's node variables are read and a layout it never makes is named",
          "[process_group]") {
  auto node = [](const char* rank, const char* local, const char* localWorld, const char* group, const char* groups) {
    auto env = std::make_unique<ScopedLaunchEnv>(rank, "4", "10.0.0.1", "29500");
    ScopedLaunchEnv::set("LOCAL_RANK", local);
    ScopedLaunchEnv::set("LOCAL_WORLD_SIZE", localWorld);
    ScopedLaunchEnv::set("GROUP_RANK", group);
    ScopedLaunchEnv::set("GROUP_WORLD_SIZE", groups);
    return env;
  };
  {
    // torchrun --nnodes 2 --nproc-per-node 2, the second node's second rank.
    auto env = node("3", "1", "2", "1", "2");
    const auto launch = zeroshard::readLaunchEnv();
    CHECK((launch.rank == 3 && launch.localRank == 1 && launch.localWorldSize == 2));
    CHECK((launch.groupRank == 1 && launch.groupWorldSize == 2 && launch.masterAddr == "10.0.0.1"));
  }
  {
    // Without the node variables: one node; with LOCAL_WORLD_SIZE alone, the node follows.
    auto one = node("3", nullptr, nullptr, nullptr, nullptr);
    const auto single = zeroshard::readLaunchEnv();
    CHECK((single.localRank == 3 && single.groupRank == 0 && single.groupWorldSize == 1));
    ScopedLaunchEnv::set("LOCAL_WORLD_SIZE", "2");
    const auto derived = zeroshard::readLaunchEnv();
    CHECK((derived.localRank == 1 && derived.groupRank == 1 && derived.groupWorldSize == 2));
  }
  {
    auto env = node("2", "0", "2", "0", "2");  // rank 2 is node 1's first rank
    CHECK(launchError().find("RANK=2 is not GROUP_RANK=0 x LOCAL_WORLD_SIZE=2 + LOCAL_RANK=0") != std::string::npos);
  }
  {
    auto env = node("1", "1", "2", "0", "3");  // 3 nodes of 2 are not a world of 4
    CHECK(launchError().find("WORLD_SIZE=4 is not 3 nodes (GROUP_WORLD_SIZE) x LOCAL_WORLD_SIZE=2") !=
          std::string::npos);
  }
  {
    auto env = node("1", "2", "2", "0", "2");
    CHECK(launchError().find("LOCAL_RANK=2 is out of range [0, 1]") != std::string::npos);
  }
  {
    auto env = node("1", "1", "2", "2", "2");
    CHECK(launchError().find("GROUP_RANK=2 is out of range [0, 1]") != std::string::npos);
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
