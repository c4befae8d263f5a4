// The sharding plan: for each model state (parameters, gradients, optimizer state) whether it is
// replicated or sharded, over which ranks, and where it lives. A ZeRO stage is a point in that
// space, not a mode: stages 0-3 are four named plans, and the plan is the only place that knows
// stage numbers. Everything else asks it a question with a name (gradsSharded(), ...).
//
// Built once from the config and the process group; a value, cheap to copy. Reading it never
// touches torch (like config.h), so any layer can include it.
//
// The ranks: a shard group (the whole world, or k consecutive ranks with hybrid sharding),
// replicated across the groups, and with hpZ a secondary group for stage-3 backward gathers.
// Offload (ZeRO-Offload) is the placement: the optimizer state (stages 1-3) and the
// parameter shards (stage 3) in host memory (docs/offload.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
  // `shardGroupSize` (hybrid sharding): sharded states are split over groups of that many
  // consecutive ranks and replicated across the groups; 0 = one group of the whole world.
  static ShardingPlan forStage(int64_t stage, int worldSize, std::string device = "cpu", int shardGroupSize = 0);
  // The plan the config asks for (zero_optimization.stage, its offload, shard group and hpZ keys);
  // `localWorldSize` is the ranks of one node, for a shard group size of "node".
  static ShardingPlan fromConfig(const Config& config, int worldSize, std::string device = "cpu",
                                 int localWorldSize = 0);

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

  // Offload: whether bucket `bucket` of `buckets` keeps its optimizer state (fp32 master weights,
  // exp_avg, exp_avg_sq, and the fp32 gradient shard it reads) in host memory and steps there.
  // With offload_optimizer.ratio r < 1, the buckets from int((1 - r) * buckets) on do, as
  // DeepSpeed splits its sub-groups; the others stay on the compute device.
  bool optimizerOnHost(size_t bucket, size_t buckets) const;
  bool anyOptimizerOnHost(size_t buckets) const;
  // optimizerOnHost(i, buckets) for every bucket i, as 0 / 1.
  std::vector<char> optimizerOnHostByBucket(size_t buckets) const;
  // Stage 3 with offload_param: every unit's parameter shard lives in host memory.
  bool paramsOnHost() const { return params_.placement == Placement::kHost; }
  // Host buffers are page-locked (with a GPU only: pinning needs one).
  bool pinOptimizer() const { return pinOptimizer_; }
  bool pinParams() const { return pinParams_; }

  // The ranks a sharded state is split over, and how many copies of each shard exist (the shard
  // groups: shardGroupSize() consecutive ranks each; a rank's replicate group: the ranks at its
  // position in every shard group). hybrid(): more than one shard group.
  int shardGroupSize() const { return shardGroupSize_; }
  int replicateGroupSize() const { return replicateGroupSize_; }
  bool hybrid() const { return replicateGroupSize_ > 1; }
  // hpZ (zero_hpz_partition_size, stage 3, a flat shard group only): backward all-gathers run
  // over groups of secondaryGroupSize() consecutive ranks, from secondary shards kept after the
  // forward's all-gather over the whole shard group. 1 = off; a size equal to the world is off
  // too (the secondary group would be the shard group).
  int secondaryGroupSize() const { return secondaryGroupSize_; }
  bool hpz() const { return secondaryGroupSize_ > 1; }
  // Collectives at two levels (hybrid or hpZ): comm_stats() splits them into intra and inter.
  bool twoLevels() const { return hybrid() || hpz(); }
  // Where the compute-device states live ("cpu", "cuda:0").
  const std::string& device() const { return device_; }
  // The ZeRO stage this plan is (recorded in checkpoints, shown to people).
  int64_t stage() const { return stage_; }

  // One line per state: what, whether sharded or replicated, over which ranks, and where, e.g.
  //   "parameters: sharded over ranks 0-1 (2 shards, 1 copy each), on cpu"
  std::string describe() const;
  // One more line for a model with frozen parameters (requires_grad=False): where they are.
  std::string describeFrozen() const;

 private:
  ShardingPlan() = default;

  int64_t stage_ = 0;
  int shardGroupSize_ = 1;
  int replicateGroupSize_ = 1;
  int secondaryGroupSize_ = 1;
  std::string device_;
  double hostRatio_ = 1.0;
  bool pinOptimizer_ = false;
  bool pinParams_ = false;
  StatePlan params_;
  StatePlan grads_;
  StatePlan optimizer_;
};

}  // namespace zeroshard
