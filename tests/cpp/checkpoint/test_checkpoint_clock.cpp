// The checkpoint clock (csrc/zeroshard/checkpoint/checkpoint_clock.*) over the one-rank Gloo group in
// this process: due every_minutes after the last save by its clock, never when off. The engine's
// saves on it: tests/cpp/engine/test_engine_clock.cpp; rank 0 deciding for 2 ranks:
// tests/python/test_clock_and_batch.py.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "single_rank_group.h"
#include "zeroshard/checkpoint/checkpoint_clock.h"
#include "zeroshard/comm/communicator.h"

using zeroshard::CheckpointClock;
using zeroshard::Communicator;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;

TEST_CASE("the clock is due every_minutes after the last save, counted from when it was set", "[checkpoint_clock]") {
  Communicator world(singleRankGroup(), kTimeout);
  CheckpointClock clock(30);
  double now = 500;
  clock.setClock([&now] { return now; });
  now = 529.9;
  CHECK_FALSE(clock.due(world, at::kCPU));
  now = 530;
  CHECK(clock.due(world, at::kCPU));
  CHECK(clock.due(world, at::kCPU));  // still due until a save
  clock.saved();
  now = 559;
  CHECK_FALSE(clock.due(world, at::kCPU));
  now = 560;
  CHECK(clock.due(world, at::kCPU));
  // The broadcasts of the decision are not the step's collectives.
  CHECK(world.stats()[zeroshard::CollectiveKind::kBroadcast].calls == 0);
}

TEST_CASE("a clock of zero minutes is never due and communicates nothing", "[checkpoint_clock]") {
  Communicator world(singleRankGroup(), kTimeout);
  CheckpointClock clock(0);
  double now = 0;
  clock.setClock([&now] { return now; });
  now = 1e9;
  CHECK_FALSE(clock.due(world, at::kCPU));
  CHECK(clock.savesOnStep());
  clock.setSavesOnStep(false);
  CHECK_FALSE(clock.savesOnStep());
}
