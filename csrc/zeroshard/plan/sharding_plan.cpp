#include "zeroshard/plan/sharding_plan.h"

#include "zeroshard/config/config.h"

#include <stdexcept>
#include <utility>

namespace zeroshard {
namespace {

std::string describeState(const char* what, const StatePlan& state, int shards, const std::string& device) {
  std::string line = std::string(what) + ": ";
  const std::string ranks = shards == 1 ? "rank 0" : "ranks 0-" + std::to_string(shards - 1);
  if (state.sharded()) {
    line += "sharded over " + ranks + " (" + std::to_string(shards) + (shards == 1 ? " shard)" : " shards)");
  } else {
    line += "replicated on " + ranks + " (every rank holds all of it)";
  }
  line += state.placement == Placement::kHost ? ", in host memory" : ", on " + device;
  return line;
}

}  // namespace

ShardingPlan ShardingPlan::forStage(int64_t stage, int worldSize, std::string device) {
  if (stage < 0 || stage > 3) {
    throw std::invalid_argument("zeroshard: there is no ZeRO stage " + std::to_string(stage) + " (0, 1, 2 or 3)");
  }
  if (worldSize < 1) throw std::invalid_argument("zeroshard: world size must be >= 1, got " + std::to_string(worldSize));
  ShardingPlan plan;
  plan.stage_ = stage;
  plan.shardGroupSize_ = worldSize;
  plan.replicateGroupSize_ = 1;
  plan.device_ = std::move(device);
  plan.optimizer_.sharding = stage >= 1 ? Sharding::kSharded : Sharding::kReplicated;
  plan.grads_.sharding = stage >= 2 ? Sharding::kSharded : Sharding::kReplicated;
  plan.params_.sharding = stage >= 3 ? Sharding::kSharded : Sharding::kReplicated;
  return plan;
}

ShardingPlan ShardingPlan::fromConfig(const Config& config, int worldSize, std::string device) {
  return forStage(config.zero.stage, worldSize, std::move(device));
}

std::string ShardingPlan::describe() const {
  return describeState("parameters", params_, shardGroupSize_, device_) + "\n" +
         describeState("gradients", grads_, shardGroupSize_, device_) + "\n" +
         describeState("optimizer state", optimizer_, shardGroupSize_, device_);
}

}  // namespace zeroshard
