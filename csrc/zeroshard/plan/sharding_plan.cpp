#include "zeroshard/plan/sharding_plan.h"

#include "zeroshard/config/config.h"

#include <stdexcept>
#include <utility>

namespace zeroshard {
namespace {

std::string describeState(const char* what, const StatePlan& state, int shards, int copies,
                          const std::string& device) {
  std::string line = std::string(what) + ": ";
  const std::string ranks = shards == 1 ? "rank 0" : "ranks 0-" + std::to_string(shards - 1);
  if (state.sharded()) {
    line += "sharded over " + ranks + " (" + std::to_string(shards) + (shards == 1 ? " shard)" : " shards)");
    if (copies > 1) {
      line += " in each of " + std::to_string(copies) + " groups of consecutive ranks (" + std::to_string(copies) +
              " copies of each shard)";
    }
  } else {
    line += "replicated on " + ranks + " (every rank holds all of it)";
  }
  line += state.placement == Placement::kHost ? ", in host memory" : ", on " + device;
  return line;
}

}  // namespace

ShardingPlan ShardingPlan::forStage(int64_t stage, int worldSize, std::string device, int shardGroupSize) {
  if (stage < 0 || stage > 3) {
    throw std::invalid_argument("zeroshard: there is no ZeRO stage " + std::to_string(stage) + " (0, 1, 2 or 3)");
  }
  if (worldSize < 1) throw std::invalid_argument("zeroshard: world size must be >= 1, got " + std::to_string(worldSize));
  ShardingPlan plan;
  plan.stage_ = stage;
  const int k = shardGroupSize == 0 ? worldSize : shardGroupSize;
  if (k < 1 || worldSize % k != 0) {
    throw std::invalid_argument("zeroshard: a shard group of " + std::to_string(k) + " ranks does not divide the "
                                "world of " + std::to_string(worldSize) + " ranks; use a size that divides it "
                                "(the ranks of one node, usually)");
  }
  if (k < worldSize && stage == 0) {
    throw std::invalid_argument("zeroshard: a shard group of " + std::to_string(k) + " ranks needs "
                                "zero_optimization.stage 1, 2 or 3 (stage 0 shards nothing)");
  }
  plan.shardGroupSize_ = k;
  plan.replicateGroupSize_ = worldSize / k;
  plan.device_ = std::move(device);
  plan.optimizer_.sharding = stage >= 1 ? Sharding::kSharded : Sharding::kReplicated;
  plan.grads_.sharding = stage >= 2 ? Sharding::kSharded : Sharding::kReplicated;
  plan.params_.sharding = stage >= 3 ? Sharding::kSharded : Sharding::kReplicated;
  return plan;
}

ShardingPlan ShardingPlan::fromConfig(const Config& config, int worldSize, std::string device, int localWorldSize) {
  int shardGroup = static_cast<int>(config.extras.shardGroupSize);
  if (config.extras.shardGroupSize == ZeroshardExtras::kShardGroupNode) {
    shardGroup = localWorldSize > 0 ? localWorldSize : worldSize;
  }
  if (shardGroup == worldSize) shardGroup = 0;
  ShardingPlan plan = forStage(config.zero.stage, worldSize, std::move(device), shardGroup);
  // The reader already turned offload off where the stage has none (with a warning).
  const auto& zero = config.zero;
  if (zero.offloadOptimizer.toHost && plan.optimizerSharded() && zero.offloadOptimizer.ratio > 0) {
    plan.optimizer_.placement = Placement::kHost;
    plan.hostRatio_ = zero.offloadOptimizer.ratio;
    plan.pinOptimizer_ = zero.offloadOptimizer.pinMemory;
  }
  if (zero.offloadParam.toHost && plan.paramsSharded()) {
    plan.params_.placement = Placement::kHost;
    plan.pinParams_ = zero.offloadParam.pinMemory;
  }
  // The reader already turned hpZ off below stage 3 (with a warning).
  const auto hpz = zero.hpzPartitionSize;
  if (hpz > 1 && plan.paramsSharded()) {
    if (plan.hybrid()) {
      throw std::invalid_argument("zeroshard: zero_optimization.zero_hpz_partition_size " + std::to_string(hpz) +
                                  " and a shard group of " + std::to_string(plan.shardGroupSize_) +
                                  " ranks (mics_shard_size / zeroshard.shard_group_size) both keep the stage-3 "
                                  "gathers inside a node; set one of them");
    }
    if (worldSize % hpz != 0) {
      throw std::invalid_argument("zeroshard: zero_optimization.zero_hpz_partition_size " + std::to_string(hpz) +
                                  " does not divide the world of " + std::to_string(worldSize) +
                                  " ranks; use a size that divides it (the ranks of one node, usually)");
    }
    if (hpz < worldSize) plan.secondaryGroupSize_ = static_cast<int>(hpz);
  }
  return plan;
}

bool ShardingPlan::optimizerOnHost(size_t bucket, size_t buckets) const {
  if (optimizer_.placement != Placement::kHost) return false;
  const auto firstOnHost = static_cast<size_t>((1.0 - hostRatio_) * static_cast<double>(buckets));
  return bucket >= firstOnHost;
}

bool ShardingPlan::anyOptimizerOnHost(size_t buckets) const {
  return buckets > 0 && optimizerOnHost(buckets - 1, buckets);
}

std::vector<char> ShardingPlan::optimizerOnHostByBucket(size_t buckets) const {
  std::vector<char> onHost;
  for (size_t i = 0; i < buckets; ++i) onHost.push_back(optimizerOnHost(i, buckets) ? 1 : 0);
  return onHost;
}

std::string ShardingPlan::describe() const {
  std::string optimizer = describeState("optimizer state", optimizer_, shardGroupSize_, replicateGroupSize_, device_);
  if (optimizer_.placement == Placement::kHost && hostRatio_ < 1.0) {
    optimizer += " (the last " + std::to_string(static_cast<int>(hostRatio_ * 100 + 0.5)) +
                 "% of the buckets; the others on " + device_ + ")";
  }
  std::string params = describeState("parameters", params_, shardGroupSize_, replicateGroupSize_, device_);
  if (hpz()) {
    params += "; hpZ: after a unit's forward each rank keeps a secondary shard of it over groups of " +
              std::to_string(secondaryGroupSize_) + " consecutive ranks, which its backward gathers from";
  }
  return params + "\n" +
         describeState("gradients", grads_, shardGroupSize_, replicateGroupSize_, device_) + "\n" + optimizer;
}

// Frozen parameters follow the parameters (Note [frozen parameters] in stage3/unit_builder.cpp).
std::string ShardingPlan::describeFrozen() const {
  return describeState("frozen parameters", params_, shardGroupSize_, replicateGroupSize_, device_) +
         (params_.sharded() ? " with their units" : "") + ", in their own dtype (no gradient, no optimizer state)";
}

}  // namespace zeroshard
