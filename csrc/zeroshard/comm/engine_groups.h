// The communicators one engine uses (docs/design.md, "Offload, and where hybrid sharding plugs
// in"): the world's, and with two levels this rank's shard and replicate groups (hybrid
// sharding) or its secondary group (hpZ); the check that every rank planned the same layout;
// and a step's collective counts, in all and by level.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/plan/sharding_plan.h"

#include <chrono>
#include <optional>

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace zeroshard {

class EngineGroups {
 public:
  // Collective over `world` (blocking): checks that every rank planned the same layout, then
  // makes this rank's subgroups (Note [hybrid groups]). Each collective is bounded by `timeout`.
  EngineGroups(c10::intrusive_ptr<c10d::ProcessGroup> world, std::chrono::milliseconds timeout,
               const ShardingPlan& plan);
  EngineGroups(EngineGroups&&) noexcept = default;

  Communicator& world() { return world_; }
  const Communicator& world() const { return world_; }
  // Where parameters, gradients and optimizer state are sharded: the shard group with hybrid
  // sharding, else the world.
  Communicator& shard() { return shard_ ? *shard_ : world_; }
  const Communicator& shard() const { return shard_ ? *shard_ : world_; }
  // Hybrid sharding's replicate group (the ranks at this rank's place in every shard group);
  // nullptr without hybrid sharding.
  Communicator* replicate() { return replicate_ ? &*replicate_ : nullptr; }
  // hpZ's secondary group, which the stage-3 backward gathers use; nullptr without hpZ.
  Communicator* secondary() { return secondary_ ? &*secondary_ : nullptr; }

  // The counts since the last reset, over every communicator.
  CommStats stepStats() const;
  void resetStepStats();
  // Ends a step: its counts become last(), intra() and inter(), and every counter is reset.
  // Hybrid: intra is the shard group, inter the replicate group (the world carries nothing of a
  // step's). hpZ: intra is the secondary groups' backward gathers, inter the world's collectives.
  void recordStep();
  const CommStats& last() const { return last_; }
  const CommStats& intra() const { return intra_; }
  const CommStats& inter() const { return inter_; }

 private:
  void checkLayoutAcrossRanks(const ShardingPlan& plan);

  Communicator world_;
  std::optional<Communicator> shard_;
  std::optional<Communicator> replicate_;
  std::optional<Communicator> secondary_;
  CommStats last_;
  CommStats intra_;
  CommStats inter_;
};

} // namespace zeroshard
