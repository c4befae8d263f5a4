#include "zeroshard/comm/engine_groups.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "zeroshard/comm/gather_values.h"
#include "zeroshard/comm/process_group.h"

#include <string>
#include <utility>
#include <vector>

namespace zeroshard {
namespace {

// Note [hybrid groups]: every rank makes its shard group, then its replicate group (or its hpZ
// secondary group); the members of each meet through the world's store under the group's name,
// so no rank waits on a group it is not in, and the order is the same everywhere. Engines made
// one after another over one world get groups of their own: the names carry how many engines
// with subgroups this rank has made over that world, a count kept in the world's store (state
// of the group passed in, not of the process), the same on every rank since every rank makes
// the same engines in the same order.
std::string subgroupPrefix(const c10::intrusive_ptr<c10d::ProcessGroup>& world) {
  const auto store = world->getStore();
  TORCH_CHECK(store, "zeroshard: hybrid sharding / hpZ: the world group has no store to make subgroups through");
  const int64_t made = store->add("zeroshard/engines_with_subgroups/" + std::to_string(world->getRank()), 1) - 1;
  return "engine" + std::to_string(made) + "/";
}

} // namespace

EngineGroups::EngineGroups(c10::intrusive_ptr<c10d::ProcessGroup> world, std::chrono::milliseconds timeout,
                           const ShardingPlan& plan)
    : world_(std::move(world), timeout) {
  // First every rank checks that all ranks planned the same groups: ranks given different
  // configs (one with a shard group, one without) would otherwise wait on groups that never
  // form until the collective timeout, with nothing naming the cause.
  checkLayoutAcrossRanks(plan);
  if (!plan.twoLevels()) return;
  const std::string prefix = subgroupPrefix(world_.group());
  if (plan.hpz()) {
    const auto ranks = hybridRanks(world_.rank(), world_.worldSize(), plan.secondaryGroupSize());
    secondary_.emplace(makeSubgroup(world_.group(), ranks.shard, prefix + "hpz/" + std::to_string(ranks.shard.front()),
                                    timeout),
                       timeout);
    return;
  }
  const auto ranks = hybridRanks(world_.rank(), world_.worldSize(), plan.shardGroupSize());
  shard_.emplace(makeSubgroup(world_.group(), ranks.shard, prefix + "shard/" + std::to_string(ranks.shard.front()),
                              timeout),
                 timeout);
  replicate_.emplace(makeSubgroup(world_.group(), ranks.replicate,
                                  prefix + "replicate/" + std::to_string(ranks.replicate.front()), timeout),
                     timeout);
}

void EngineGroups::checkLayoutAcrossRanks(const ShardingPlan& plan) {
  if (world_.worldSize() == 1) return;
  const std::vector<int64_t> mine{plan.stage(), plan.shardGroupSize(), plan.secondaryGroupSize()};
  const auto all = allGatherValues(world_, mine, c10::Device(plan.device()));
  auto describe = [](const std::vector<int64_t>& v) {
    return "stage " + std::to_string(v.at(0)) + ", shard groups of " + std::to_string(v.at(1)) + ", hpZ " +
           (v.at(2) > 1 ? "groups of " + std::to_string(v.at(2)) : std::string("off"));
  };
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == mine, "zeroshard: the ranks planned different layouts: rank ", world_.rank(), " has ",
                describe(mine), " but rank ", r, " has ", describe(all[r]),
                "; give every rank the same zero_optimization.stage, shard_group_size / mics_shard_size and "
                "zero_hpz_partition_size (and, for \"node\", the same LOCAL_WORLD_SIZE)");
  }
}

CommStats EngineGroups::stepStats() const {
  CommStats stats = world_.stats();
  for (const auto* group : {&shard_, &replicate_, &secondary_}) {
    if (*group) stats.add((*group)->stats());
  }
  return stats;
}

void EngineGroups::resetStepStats() {
  world_.resetStats();
  for (auto* group : {&shard_, &replicate_, &secondary_}) {
    if (*group) (*group)->resetStats();
  }
}

void EngineGroups::recordStep() {
  last_ = stepStats();
  if (secondary_) {
    intra_ = secondary_->stats();
    inter_ = world_.stats();
  } else {
    intra_ = shard_ ? shard_->stats() : CommStats();
    inter_ = replicate_ ? replicate_->stats() : CommStats();
  }
  resetStepStats();
}

} // namespace zeroshard
