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
  ShardingPlan plan = forStage(config.zero.stage, worldSize, std::move(device));
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
  std::string optimizer = describeState("optimizer state", optimizer_, shardGroupSize_, device_);
  if (optimizer_.placement == Placement::kHost && hostRatio_ < 1.0) {
    optimizer += " (the last " + std::to_string(static_cast<int>(hostRatio_ * 100 + 0.5)) +
                 "% of the buckets; the others on " + device_ + ")";
  }
  return describeState("parameters", params_, shardGroupSize_, device_) + "\n" +
         describeState("gradients", grads_, shardGroupSize_, device_) + "\n" + optimizer;
}

}  // namespace zeroshard
