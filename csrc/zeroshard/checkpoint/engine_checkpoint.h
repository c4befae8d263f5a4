// The checkpoint protocol of an engine: every rank writes its own shards of the fp32 master
// weights and AdamW state, rank 0 adds the manifest and publishes (directory.h); a load maps
// each of this rank's flat ranges back to parameters by name, so the saving world size and
// stage do not matter (reader.h). The format is in manifest.h; docs/checkpoints.md for users.
// The save is engine_checkpoint.cpp, the load engine_checkpoint_load.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/optim/accumulation_window.h"
#include "zeroshard/state/module_state.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/config/config.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/optim/bucket_slots.h"
#include "zeroshard/optim/loss_scaler.h"
#include "zeroshard/optim/lr_schedule.h"
#include "zeroshard/optim/optimizer.h"
#include "zeroshard/plan/sharding_plan.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class EngineGroups;
class ModelState;
class OptimizerStep;
struct CheckpointManifest;

struct LoadOptions {
  // false: only the weights (fine-tuning from a checkpoint): AdamW state, step count,
  // hyper-parameters, loss scale and counters stay as this engine has them, and the param
  // groups may be split differently from the saving run's. DeepSpeed's load_optimizer_states.
  bool optimizerStates = true;
  // Not empty: an error this rank met before the call (e.g. reading its client state); the
  // load then fails on every rank, naming it, and changes nothing.
  std::string rankError;
  // Given the saved client state once it is read, before anything changes; a non-empty result
  // is this rank's error (the load then fails on every rank and changes nothing). The Python
  // layer unpickles the client state here, so that it is read once.
  std::function<std::string(const std::string& clientState)> checkClientState;
  // The config's learning-rate schedule takes the saved last_batch_iteration (DeepSpeed's
  // load_lr_scheduler_states). false, or a checkpoint without one (saved without a schedule,
  // or by an older zeroshard): the schedule keeps its own. Either way the schedule owns the
  // lr: unless both it and the optimizer states were loaded, its current values are put into
  // the param groups after the load (docs/config.md, "Learning-rate schedules").
  bool loadSchedulerState = true;
};

struct LoadedCheckpoint {
  std::string path;         // the checkpoint directory read
  std::string tag;
  std::string clientState;  // what save_checkpoint was given (empty if nothing)
  bool schedulerStateLoaded = false;  // the schedule took the checkpoint's last_batch_iteration
};

// What a checkpoint reads and writes of an engine, lent for one save or load. The engine owns
// all of it.
struct CheckpointedState {
  const Config& config;
  const ShardingPlan& plan;
  Communicator& comm;
  at::ScalarType computeDtype;
  const std::vector<Bucket>& buckets;
  const std::vector<std::vector<OptimizerSlot>>& slots;
  ShardedAdamW& optimizer;
  LossScaler* scaler;  // fp16 only
  ModuleState& moduleState;
  // Stage 3: the frozen parameters' flat buffers (ModuleState::sharded), and a call that makes
  // frozen bucket b whole on every rank while `use` runs (collective: every rank calls it for
  // the same b in the same order). Below stage 3 there are none.
  const std::vector<Bucket>& frozenBuckets;
  std::function<void(size_t frozenBucket, const std::function<void()>& use)> withFrozenWhole;
  // The boundaries passed are saved; a load restores them with no window open (checkpoints are
  // taken between windows).
  AccumulationWindow& window;
  int64_t& skippedSteps;
  LrSchedule* schedule;  // none without a config "scheduler"
  // This rank's place in its shard group (hybrid sharding; otherwise the world's rank and size).
  // A checkpoint is what one shard group holds: the ranks of the first group write the rank
  // files, as a checkpoint of shardCount ranks; every rank takes part in the agreements and
  // reads its own slices on load.
  int shardRank = 0;
  int shardCount = 1;
  // The batch this run trains with, over comm's world (recorded; the batch guard on load).
  BatchSizes batch{0, 0, 0};
};

// The batch guard: when the checkpoint `m` recorded a global batch other than `batch` over
// `worldSize` ranks, what a person should read (the old and new numbers, and the
// gradient_accumulation_steps that would keep the old one, when one does); nothing otherwise
// and for checkpoints that recorded none.
std::optional<std::string> batchChange(const CheckpointManifest& m, const BatchSizes& batch, int worldSize);

// Collective and blocking. Returns the published checkpoint's path; `tag` empty means
// "global_step<N>". clientState is saved from rank 0; `rankError`, when not empty, fails the
// save on every rank, naming it, and publishes nothing. `excludeFrozen` (DeepSpeed's
// exclude_frozen_parameters): the frozen parameters are not saved (the manifest says so); a
// load keeps the ones the engine has.
std::string saveCheckpoint(CheckpointedState state, const std::string& dir, const std::string& tag,
                           const std::string& clientState, const std::string& rankError,
                           bool excludeFrozen = false);
// The view of an engine's parts that one save or load takes (engine_checkpoint.cpp): the
// model state's buffers, the optimizer step's loss scale, schedule and skipped steps, the
// window's counters, and the shard group's place.
CheckpointedState checkpointedState(const Config& config, const BatchSizes& batch, EngineGroups& groups,
                                    ModelState& model, OptimizerStep& step, AccumulationWindow& window);

// Collective and blocking; `tag` empty: the `latest` one. Everything is read and checked before
// anything changes, on every rank; then the master weights, AdamW state, counters, loss scale,
// module state and schedule state are written. The caller then makes the parameters follow the
// masters (and the param groups follow the schedule, LoadOptions::loadSchedulerState).
LoadedCheckpoint loadCheckpoint(CheckpointedState state, const std::string& dir, const std::string& tag,
                                const LoadOptions& options);

}  // namespace zeroshard
