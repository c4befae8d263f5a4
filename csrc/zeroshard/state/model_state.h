// The model state the sharding plan chose for one model: the flat buckets of trained parameters
// (and of frozen ones at stage 3), the parameter storage (replicated, or stage 3's unit
// scheduler), the gradient storage and its reducer, the fp32 master weights, the optimizer and
// each bucket's slots in it, the map from the caller's unit specs to stage-3 units, and the
// module state (buffers, frozen parameters kept whole, tied names). It is built complete from
// the model's parameters and owns every buffer above; the engine sequences it, and the features
// (checkpoints, the export, pretrained loading, meta init) take it by reference for a call.
//
// Nothing here decides when a step happens or how gradients are checked and clipped
// (optim/optimizer_step.h, which gets what it steps from stepped()); it answers what is held,
// where, and by which name.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/layout/param_groups.h"
#include "zeroshard/optim/bucket_slots.h"
#include "zeroshard/optim/master_weights.h"
#include "zeroshard/optim/optimizer.h"
#include "zeroshard/optim/stepped_state.h"
#include "zeroshard/plan/sharding_plan.h"
#include "zeroshard/stage3/unit_builder.h"
#include "zeroshard/state/memory_stats.h"
#include "zeroshard/state/meta_init.h"
#include "zeroshard/state/module_state.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class Communicator;
class EngineGroups;
class GradReducer;
class GradStorage;
class ParamStorage;
class UnitScheduler;
struct Config;

// What the engine is given about the model.
struct ModelInputs {
  std::vector<ParamGroupSpec> groups;
  // Stage 3 only; empty means one root unit holding every parameter.
  std::vector<UnitSpec> units;
  // The parameters are on the meta device (all of them, or none); ignored otherwise.
  MetaInit init;
  // The model's frozen parameters (requires_grad=False), each once under its first name:
  // sharded with their units at stage 3 (Note [frozen parameters] in stage3/unit_builder.cpp),
  // whole below it; every rank takes rank 0's values.
  std::vector<std::pair<std::string, at::Tensor>> frozen;
  // The model's state dict, every name in order, when the engine is given the module itself
  // (module_inputs.h): its module state is taken from it at construction (setModuleState), and
  // with broadcastStateDict every rank takes rank 0's. The Python layer sets it afterwards.
  std::vector<std::pair<std::string, at::Tensor>> stateDict;
  bool broadcastStateDict = false;
};

class ModelState {
 public:
  // Collective and blocking: every rank starts from rank 0's parameters (broadcast over the
  // world), or, on the meta device, runs initFromMeta. `groups` gives the communicators the
  // storage uses for the state's lifetime (the engine owns both and outlives neither).
  ModelState(ModelInputs model, const Config& config, const ShardingPlan& plan, EngineGroups& groups);
  ~ModelState();
  ModelState(const ModelState&) = delete;
  ModelState& operator=(const ModelState&) = delete;

  const ShardingPlan& plan() const { return plan_; }
  // The dtype parameters, gradients and gathers use: bf16 or fp16 where enabled, else float32.
  at::ScalarType computeDtype() const { return computeDtype_; }
  // Where the parameters are computed with (the first bucket's device).
  at::Device device() const { return buckets_.front().flatParams().device(); }
  // This rank's index in the group sharded states live on.
  int shardRank() const { return shardRank_; }

  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Frozen parameters: their flat buffers at stage 3 (one per unit and dtype), and those kept
  // whole (every one below stage 3; at stage 3 those at or under the persistence threshold).
  std::vector<Bucket>& frozenBuckets() { return frozenBuckets_; }
  const std::vector<Bucket>& frozenBuckets() const { return frozenBuckets_; }
  const std::vector<std::pair<std::string, at::Tensor>>& frozenWhole() const { return frozenWhole_; }
  MasterWeights& masters() { return *masters_; }
  ShardedAdamW& optimizer() { return optimizer_; }
  const ShardedAdamW& optimizer() const { return optimizer_; }
  const std::vector<std::vector<OptimizerSlot>>& slots() const { return slots_; }
  GradStorage& grads() { return *grads_; }
  GradReducer& reducer() { return *reducer_; }
  ParamStorage& params() { return *params_; }
  // Stage 3's scheduler (the parameter storage), nullptr below stage 3.
  UnitScheduler* units() { return units_; }
  const UnitScheduler* units() const { return units_; }
  ModuleState& moduleState() { return moduleState_; }

  // What the optimizer step reads and writes, lent for one call.
  SteppedState stepped();
  // Records the last step's peaks (memoryStats) and starts counting the next step's.
  void recordPeaks();
  // After the master weights were replaced (a checkpoint load): the parameters (every copy,
  // stage 3's gathered ones released first) take their values, and the gradients are zeroed.
  void followMasters();
  MemoryStats memoryStats() const;

  // Every trained parameter, by its original name (full tensors; stages 0-2 keep them whole).
  std::vector<std::pair<std::string, at::Tensor>> namedParameters() const;
  // Every trained parameter's fp32 master weights, whole, as new CPU tensors. Collective over
  // `shardComm` where the optimizer is sharded (uncounted); one bucket's buffer at a time.
  std::vector<std::pair<std::string, at::Tensor>> masterWeights(Communicator& shardComm);
  // Whole values into trained and frozen parameters, by name (Engine::setParameters).
  void setParameters(const std::vector<std::pair<std::string, at::Tensor>>& values);

  // Stage-3 hooks by unit spec (Engine::preForward); errors below stage 3.
  void preForward(size_t unitSpec, const std::optional<std::vector<at::Tensor>>& inputs);
  void postForward(size_t unitSpec, const std::vector<at::Tensor>& outputs);
  bool watchesInputs(size_t unitSpec) const;
  const std::vector<UnitInfo>& unitInfos() const { return unitInfos_; }
  // Stage 3: runs `use` with frozen bucket `frozenBucket` whole on every rank (its unit gathered
  // for the call unless it was). Collective.
  void withFrozenWhole(size_t frozenBucket, const std::function<void()>& use);

  // Module state (module_state.h): checked against the buckets, then kept.
  void setModuleState(ModuleState state);
  // Every rank takes rank 0's module state (uncounted broadcasts over `world`).
  void broadcastModuleState(Communicator& world);

 private:
  void checkUnitSpec(size_t unitSpec) const;

  ShardingPlan plan_;
  at::ScalarType computeDtype_ = at::kFloat;
  int shardRank_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<Bucket> frozenBuckets_;
  std::vector<std::pair<std::string, at::Tensor>> frozenWhole_;
  std::optional<MasterWeights> masters_;  // built with the buckets
  ShardedAdamW optimizer_;
  std::unique_ptr<GradStorage> grads_;  // before reducer_, which drives it
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<ParamStorage> params_;  // chosen by the plan
  UnitScheduler* units_ = nullptr;        // params_ at stage 3, for the module hooks
  std::vector<std::optional<UnitIndex>> specToUnit_;  // none: a unit without parameters of its own
  std::vector<UnitInfo> unitInfos_;
  std::vector<std::vector<OptimizerSlot>> slots_;  // each bucket's optimizer state
  ModuleState moduleState_;
  int64_t lastPeakGatheredBytes_ = 0;
  int64_t lastPeakSecondaryBytes_ = 0;
  int64_t lastPeakStagingBytes_ = 0;
};

} // namespace zeroshard
