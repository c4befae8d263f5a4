// Hybrid sharding's groups (docs/design.md, "Offload, and where hybrid sharding plugs in"): the
// shard and replicate communicators an engine makes, and one step's counts over all of them.
#include "zeroshard/engine.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zeroshard/comm/process_group.h"

#include <string>

namespace zeroshard {

// Note [hybrid groups]: every rank makes its shard group, then its replicate group; the members
// of each meet through the world's store under the group's name, so no rank waits on a group it
// is not in, and the order is the same everywhere.
// Engines made one after another in one process get groups of their own: the names carry a
// count of hybrid engines made here, which is the same on every rank (every rank makes the same
// engines in the same order).
void Engine::makeHybridGroups() {
  if (!plan_.hybrid()) return;
  static int made = 0;
  const std::string prefix = "engine" + std::to_string(made++) + "/";
  const auto ranks = hybridRanks(comm_.rank(), comm_.worldSize(), plan_.shardGroupSize());
  shardGroup_.emplace(makeSubgroup(comm_.group(), ranks.shard, prefix + "shard/" + std::to_string(ranks.shard.front()),
                                   comm_.timeout()),
                      comm_.timeout());
  replicateGroup_.emplace(makeSubgroup(comm_.group(), ranks.replicate,
                                       prefix + "replicate/" + std::to_string(ranks.replicate.front()),
                                       comm_.timeout()),
                          comm_.timeout());
}

CommStats Engine::stepStats() const {
  CommStats stats = comm_.stats();
  if (shardGroup_) stats.add(shardGroup_->stats());
  if (replicateGroup_) stats.add(replicateGroup_->stats());
  return stats;
}

void Engine::resetStepStats() {
  comm_.resetStats();
  if (shardGroup_) shardGroup_->resetStats();
  if (replicateGroup_) replicateGroup_->resetStats();
}

} // namespace zeroshard
