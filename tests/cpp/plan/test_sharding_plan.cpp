// The sharding plan (csrc/zeroshard/plan/sharding_plan.*): the four stages as named plans, the
// questions the engine asks, and the description people read.
#include "catch.h"

#include "zeroshard/config/config.h"
#include "zeroshard/plan/sharding_plan.h"

#include <stdexcept>
#include <string>
#include <vector>

using zeroshard::Config;
using zeroshard::ShardingPlan;

TEST_CASE("each ZeRO stage is a plan that shards one more state than the stage below") {
  struct Expected {
    bool optimizer, grads, params;
  };
  const Expected expected[] = {{false, false, false}, {true, false, false}, {true, true, false}, {true, true, true}};
  for (int stage = 0; stage <= 3; ++stage) {
    const ShardingPlan plan = ShardingPlan::forStage(stage, 4);
    INFO("stage " << stage);
    CHECK(plan.stage() == stage);
    CHECK(plan.optimizerSharded() == expected[stage].optimizer);
    CHECK(plan.gradsSharded() == expected[stage].grads);
    CHECK(plan.paramsSharded() == expected[stage].params);
    CHECK(plan.shardGroupSize() == 4);
    CHECK(plan.replicateGroupSize() == 1);
    CHECK(plan.params().placement == zeroshard::Placement::kComputeDevice);
  }
}

TEST_CASE("the plan comes from zero_optimization.stage") {
  const Config config = Config::fromJsonString(R"({"zero_optimization": {"stage": 2}})");
  const ShardingPlan plan = ShardingPlan::fromConfig(config, 2);
  CHECK(plan.gradsSharded());
  CHECK_FALSE(plan.paramsSharded());
}

TEST_CASE("describe gives one line per state naming its sharding and ranks and place") {
  CHECK(ShardingPlan::forStage(3, 2, "cuda:0").describe() ==
        "parameters: sharded over ranks 0-1 (2 shards), on cuda:0\n"
        "gradients: sharded over ranks 0-1 (2 shards), on cuda:0\n"
        "optimizer state: sharded over ranks 0-1 (2 shards), on cuda:0");
  CHECK(ShardingPlan::forStage(1, 1).describe() ==
        "parameters: replicated on rank 0 (every rank holds all of it), on cpu\n"
        "gradients: replicated on rank 0 (every rank holds all of it), on cpu\n"
        "optimizer state: sharded over rank 0 (1 shard), on cpu");
}

TEST_CASE("offload places the optimizer state (by bucket, with ratio) and stage-3 parameters in host memory") {
  const Config both = Config::fromJsonString(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu",
          "pin_memory": false}}})");
  const ShardingPlan plan = ShardingPlan::fromConfig(both, 2, "cuda:0");
  CHECK(plan.paramsOnHost());
  CHECK(plan.pinOptimizer());
  CHECK_FALSE(plan.pinParams());
  CHECK(plan.optimizerOnHostByBucket(3) == std::vector<char>{1, 1, 1});
  CHECK(plan.describe() ==
        "parameters: sharded over ranks 0-1 (2 shards), in host memory\n"
        "gradients: sharded over ranks 0-1 (2 shards), on cuda:0\n"
        "optimizer state: sharded over ranks 0-1 (2 shards), in host memory");

  // DeepSpeed's partial offload: of n sub-groups (here buckets), those from int((1 - ratio) * n).
  const Config partial =
      Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})");
  const ShardingPlan half = ShardingPlan::fromConfig(partial, 2);
  CHECK_FALSE(half.paramsOnHost());
  CHECK(half.optimizerOnHostByBucket(4) == std::vector<char>{0, 0, 1, 1});
  CHECK(half.optimizerOnHostByBucket(3) == std::vector<char>{0, 1, 1});
  CHECK(half.optimizerOnHostByBucket(1) == std::vector<char>{1});
  CHECK(half.anyOptimizerOnHost(1));
  CHECK(half.describe().find("optimizer state: sharded over ranks 0-1 (2 shards), in host memory (the last 50% of the "
                             "buckets; the others on cpu)") != std::string::npos);
  const Config none =
      Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}})");
  CHECK_FALSE(ShardingPlan::fromConfig(none, 2).anyOptimizerOnHost(4));
  CHECK_FALSE(ShardingPlan::fromConfig(Config::fromJsonString("{}"), 2).anyOptimizerOnHost(4));
}

TEST_CASE("hybrid sharding shards over groups of consecutive ranks and replicates across them") {
  const Config config = Config::fromJsonString(R"({"zero_optimization": {"stage": 3}, "zeroshard": {"shard_group_size": 2}})");
  const ShardingPlan plan = ShardingPlan::fromConfig(config, 8);
  CHECK(plan.shardGroupSize() == 2);
  CHECK(plan.replicateGroupSize() == 4);
  CHECK(plan.hybrid());
  CHECK(plan.describe().find("parameters: sharded over ranks 0-1 (2 shards) in each of 4 groups of consecutive "
                             "ranks (4 copies of each shard), on cpu") == 0);
  // "node": the ranks of one node; the whole world is one group, as without the key.
  const Config node = Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "mics_shard_size": "node"}})");
  CHECK(ShardingPlan::fromConfig(node, 8, "cpu", 4).shardGroupSize() == 4);
  CHECK_FALSE(ShardingPlan::fromConfig(node, 4, "cpu", 4).hybrid());
  const Config off = Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "mics_shard_size": -1}})");
  CHECK_FALSE(ShardingPlan::fromConfig(off, 8).hybrid());
  CHECK_THROWS_AS(ShardingPlan::forStage(2, 6, "cpu", 4), std::invalid_argument);
  CHECK_THROWS_AS(ShardingPlan::forStage(0, 4, "cpu", 2), std::invalid_argument);
  CHECK_THROWS_AS(Config::fromJsonString(R"({"zero_optimization": {"mics_shard_size": 2}, "zeroshard": {"shard_group_size": 4}})"),
                  zeroshard::ConfigError);
}

TEST_CASE("hpZ keeps stage 3's backward gathers in groups of consecutive ranks over a flat shard group") {
  auto plan = [](const char* zero, int world) {
    return ShardingPlan::fromConfig(Config::fromJsonString(std::string(R"({"zero_optimization": )") + zero + "}"),
                                    world);
  };
  const ShardingPlan hpz = plan(R"({"stage": 3, "zero_hpz_partition_size": 2})", 8);
  CHECK(hpz.hpz());
  CHECK(hpz.twoLevels());
  CHECK(hpz.secondaryGroupSize() == 2);
  CHECK(hpz.shardGroupSize() == 8);  // the primary shards span the world
  CHECK_FALSE(hpz.hybrid());
  CHECK(hpz.describe().find("secondary shard of it over groups of 2 consecutive ranks") != std::string::npos);
  // Off: the default 1, a group of the whole world, and stages 0-2 (the reader warns there).
  CHECK_FALSE(plan(R"({"stage": 3})", 8).twoLevels());
  CHECK_FALSE(plan(R"({"stage": 3, "zero_hpz_partition_size": 8})", 8).hpz());
  const Config stage2 = Config::fromJsonString(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})");
  CHECK(stage2.zero.hpzPartitionSize == 1);
  REQUIRE(stage2.warnings.size() == 1);
  CHECK(stage2.warnings[0].find("ignored at zero_optimization.stage 2") != std::string::npos);
  CHECK_FALSE(ShardingPlan::fromConfig(stage2, 8).hpz());
  // Refused: a size that does not divide the world, hpZ with a hybrid shard group, 0.
  CHECK_THROWS_AS(plan(R"({"stage": 3, "zero_hpz_partition_size": 3})", 8), std::invalid_argument);
  CHECK_THROWS_AS(plan(R"({"stage": 3, "zero_hpz_partition_size": 2, "mics_shard_size": 4})", 8),
                  std::invalid_argument);
  CHECK_THROWS_AS(plan(R"({"stage": 3, "zero_hpz_partition_size": 0})", 8), zeroshard::ConfigError);
}

TEST_CASE("a stage outside 0-3 or an empty world is not a plan") {
  CHECK_THROWS_AS(ShardingPlan::forStage(4, 2), std::invalid_argument);
  CHECK_THROWS_AS(ShardingPlan::forStage(-1, 2), std::invalid_argument);
  CHECK_THROWS_AS(ShardingPlan::forStage(1, 0), std::invalid_argument);
}
