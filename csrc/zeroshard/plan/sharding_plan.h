// The sharding plan: for each model state (parameters, gradients, optimizer state) whether it is
// replicated or sharded, over which ranks, and where it lives. A ZeRO stage is a point in that
// space, not a mode: stages 0-3 are four named plans, and the plan is the only place that knows
// stage numbers. Everything else asks it a question with a name (gradsSharded(), ...).
//
// Built once from the config and the process group; a value, cheap to copy. Reading it never
// touches torch (like config.h), so any layer can include it.
//
// Today the shard group is the whole world and the replicate group has one member; hybrid
// sharding (a shard group per node, replication across nodes) and offload (host placement)
// are new values of these fields, not new branches in the engine.
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

struct Config;

enum class Sharding { kReplicated, kSharded };
enum class Placement { kComputeDevice, kHost };

// One model state's part of the plan.
struct StatePlan {
  Sharding sharding = Sharding::kReplicated;
  Placement placement = Placement::kComputeDevice;
  bool sharded() const { return sharding == Sharding::kSharded; }
};

class ShardingPlan {
 public:
  // ZeRO stage `stage` (0-3) for `worldSize` ranks: 0 replicates everything, 1 shards the
  // optimizer state, 2 also the gradients, 3 also the parameters. `device` names where the
  // compute device states live ("cpu", "cuda:0"), for describe().
  static ShardingPlan forStage(int64_t stage, int worldSize, std::string device = "cpu");
  // The plan the config asks for (zero_optimization.stage).
  static ShardingPlan fromConfig(const Config& config, int worldSize, std::string device = "cpu");

  const StatePlan& params() const { return params_; }
  const StatePlan& grads() const { return grads_; }
  const StatePlan& optimizerState() const { return optimizer_; }

  // Stage 3: parameters exist only as shards between uses (units gathered around their use).
  bool paramsSharded() const { return params_.sharded(); }
  // Stages 2-3: each rank keeps only its gradient shard, reduce-scattered every micro-batch.
  bool gradsSharded() const { return grads_.sharded(); }
  // Stages 1-3: each rank steps only its shard of the fp32 master weights and AdamW state, so
  // anything computed over the gradients (norm, overflow) is summed over the shard group, and
  // updated parameters are gathered after the step.
  bool optimizerSharded() const { return optimizer_.sharded(); }

  // The ranks a sharded state is split over, and how many copies of each shard exist.
  int shardGroupSize() const { return shardGroupSize_; }
  int replicateGroupSize() const { return replicateGroupSize_; }
  // The ZeRO stage this plan is (recorded in checkpoints, shown to people).
  int64_t stage() const { return stage_; }

  // One line per state: what, whether sharded or replicated, over which ranks, and where, e.g.
  //   "parameters: sharded over ranks 0-1 (2 shards, 1 copy each), on cpu"
  std::string describe() const;

 private:
  ShardingPlan() = default;

  int64_t stage_ = 0;
  int shardGroupSize_ = 1;
  int replicateGroupSize_ = 1;
  std::string device_;
  StatePlan params_;
  StatePlan grads_;
  StatePlan optimizer_;
};

}  // namespace zeroshard
