// Hybrid sharding's groups (docs/design.md, "Offload, and where hybrid sharding plugs in"): the
// shard and replicate communicators an engine makes, and one step's counts over all of them.
#include "zeroshard/engine.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/gather_values.h"
#include "zeroshard/comm/process_group.h"

#include <string>
#include <vector>

namespace zeroshard {

// Note [hybrid groups]: every rank makes its shard group, then its replicate group; the members
// of each meet through the world's store under the group's name, so no rank waits on a group it
// is not in, and the order is the same everywhere.
// Engines made one after another in one process get groups of their own: the names carry a
// count of hybrid engines made here, which is the same on every rank (every rank makes the same
// engines in the same order).
// hpZ's secondary groups are made the same way, after them.
//
// First every rank checks that all ranks planned the same groups: ranks given different
// configs (one with a shard group, one without) would otherwise wait on groups that never form
// until the collective timeout, with nothing naming the cause.
void Engine::makeHybridGroups() {
  checkLayoutAcrossRanks();
  if (!plan_.twoLevels()) return;
  static int made = 0;
  const std::string prefix = "engine" + std::to_string(made++) + "/";
  if (plan_.hpz()) {
    const auto ranks = hybridRanks(comm_.rank(), comm_.worldSize(), plan_.secondaryGroupSize());
    secondaryGroup_.emplace(makeSubgroup(comm_.group(), ranks.shard,
                                         prefix + "hpz/" + std::to_string(ranks.shard.front()), comm_.timeout()),
                            comm_.timeout());
    return;
  }
  const auto ranks = hybridRanks(comm_.rank(), comm_.worldSize(), plan_.shardGroupSize());
  shardGroup_.emplace(makeSubgroup(comm_.group(), ranks.shard, prefix + "shard/" + std::to_string(ranks.shard.front()),
                                   comm_.timeout()),
                      comm_.timeout());
  replicateGroup_.emplace(makeSubgroup(comm_.group(), ranks.replicate,
                                       prefix + "replicate/" + std::to_string(ranks.replicate.front()),
                                       comm_.timeout()),
                          comm_.timeout());
}

void Engine::checkLayoutAcrossRanks() {
  if (comm_.worldSize() == 1) return;
  const std::vector<int64_t> mine{plan_.stage(), plan_.shardGroupSize(), plan_.secondaryGroupSize()};
  const auto all = allGatherValues(comm_, mine, c10::Device(plan_.device()));
  auto describe = [](const std::vector<int64_t>& v) {
    return "stage " + std::to_string(v.at(0)) + ", shard groups of " + std::to_string(v.at(1)) + ", hpZ " +
           (v.at(2) > 1 ? "groups of " + std::to_string(v.at(2)) : std::string("off"));
  };
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == mine, "zeroshard: the ranks planned different layouts: rank ", comm_.rank(), " has ",
                describe(mine), " but rank ", r, " has ", describe(all[r]),
                "; give every rank the same zero_optimization.stage, shard_group_size / mics_shard_size and "
                "zero_hpz_partition_size (and, for \"node\", the same LOCAL_WORLD_SIZE)");
  }
}

CommStats Engine::stepStats() const {
  CommStats stats = comm_.stats();
  for (const auto* group : {&shardGroup_, &replicateGroup_, &secondaryGroup_}) {
    if (*group) stats.add((*group)->stats());
  }
  return stats;
}

void Engine::resetStepStats() {
  comm_.resetStats();
  for (auto* group : {&shardGroup_, &replicateGroup_, &secondaryGroup_}) {
    if (*group) (*group)->resetStats();
  }
}

// Hybrid: the shard group is inside a node, the replicate group across (the world's own
// communicator carries nothing of a step's). hpZ: the secondary group is inside a node, and the
// world's collectives (the forward gathers, the reduce-scatters) cross nodes.
void Engine::recordStepStats() {
  lastStepStats_ = stepStats();
  if (secondaryGroup_) {
    lastIntraStats_ = secondaryGroup_->stats();
    lastInterStats_ = comm_.stats();
  } else {
    lastIntraStats_ = shardGroup_ ? shardGroup_->stats() : CommStats();
    lastInterStats_ = replicateGroup_ ? replicateGroup_->stats() : CommStats();
  }
  resetStepStats();
}

} // namespace zeroshard
