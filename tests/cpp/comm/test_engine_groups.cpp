// The communicators of one engine (csrc/zeroshard/comm/engine_groups.*) over the one-rank Gloo
// group in this process: which communicator each role is without two levels, and a step's counts.
// The subgroups of hybrid sharding and hpZ, and their names when one process makes several
// engines over one world, are held at 2 and 4 ranks by tests/python/test_hybrid.py and
// test_hpz.py (every case there makes another engine in the same processes).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#undef CHECK
#include "catch.h"

#include "single_rank_group.h"
#include "zeroshard/comm/engine_groups.h"

using zeroshard::CollectiveKind;
using zeroshard::EngineGroups;
using zeroshard::ShardingPlan;
using zeroshard::testing::kTimeout;
using zeroshard::testing::singleRankGroup;

TEST_CASE("without two levels the shard group is the world and there is no replicate or secondary group",
          "[engine_groups]") {
  for (int stage : {0, 1, 2, 3}) {
    EngineGroups groups(singleRankGroup(), kTimeout, ShardingPlan::forStage(stage, 1));
    CHECK(&groups.shard() == &groups.world());
    CHECK(groups.replicate() == nullptr);
    CHECK(groups.secondary() == nullptr);
    CHECK(groups.world().worldSize() == 1);
  }
}

TEST_CASE("a step's counts become last() when it is recorded, and the next step starts from zero",
          "[engine_groups]") {
  EngineGroups groups(singleRankGroup(), kTimeout, ShardingPlan::forStage(3, 1));
  groups.resetStepStats();  // whatever the construction counted
  at::Tensor values = at::ones({6}, at::kFloat);
  groups.world().allReduce(values).wait();
  groups.world().allReduce(values).wait();
  CHECK(groups.stepStats()[CollectiveKind::kAllReduce].calls == 2);
  CHECK(groups.stepStats()[CollectiveKind::kAllReduce].bytes == 2 * 6 * 4);
  groups.recordStep();
  CHECK(groups.last()[CollectiveKind::kAllReduce].calls == 2);
  CHECK(groups.last()[CollectiveKind::kAllReduce].bytes == 48);
  // One level: nothing is inside or across a shard group.
  CHECK(groups.intra().trafficBytes() == 0);
  CHECK(groups.inter().trafficBytes() == 0);
  CHECK(groups.stepStats().trafficBytes() == 0);
  groups.world().allReduce(values).wait();
  groups.recordStep();
  CHECK(groups.last()[CollectiveKind::kAllReduce].calls == 1);
}
