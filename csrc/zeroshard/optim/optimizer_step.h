// The optimizer step at an accumulation boundary, around the sharded AdamW the model state
// holds: fp16's loss scaling, the non-finite check (immediate, or deferred to the device: Note
// [deferred nonfinite check] in nonfinite_check.cpp), the global gradient norm and clipping,
// the update itself (bucket by bucket when the optimizer is offloaded), and the config's
// learning-rate schedule. It owns the state those keep between steps (the loss scale, the
// schedule, the skipped steps, the last step's norm and flag); what it steps of the model state
// is lent for each call (SteppedState).
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/optim/deferred_skip.h"
#include "zeroshard/optim/loss_scaler.h"
#include "zeroshard/optim/lr_schedule.h"
#include "zeroshard/optim/stepped_state.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

class Communicator;
class ShardedAdamW;
struct Config;

class OptimizerStep {
 public:
  // With a config "scheduler", puts its start values into the optimizer's groups. `rank` is
  // the world rank (rank 0 warns for every rank).
  OptimizerStep(const Config& config, const SteppedState& state, int rank);

  // The step at the boundary numbered `boundary` (the windows ended, this one included), once
  // the window's gradients are reduced: returns false when it was skipped (fp16's overflow,
  // zeroshard.nonfinite "skip"), true when taken (with the deferred check: taken as far as
  // the host knows). The gradients are zeroed either way. Collective over `shardComm` where the
  // optimizer is sharded (the overflow flag, the norm, naming a non-finite gradient). The
  // caller records the step's peaks and collectives after it (ModelState::recordPeaks).
  bool take(const SteppedState& state, Communicator& shardComm, int64_t boundary);
  // The deferred check: reads the last step's flag (blocking) and acts on it as
  // zeroshard.nonfinite says ("error" raises, "skip" counts); a no-op when settled already.
  // `where` names, for the error, where it was found (none: at the step numbered `boundary`).
  void settle(const SteppedState& state, int64_t boundary, const std::optional<std::string>& where = std::nullopt);
  // Whether the deferred check is used (decided at construction).
  bool defersNonfiniteCheck() const { return deferred_; }

  // fp16: the current loss scale (1 otherwise).
  double lossScale() const { return scaler_ ? scaler_->scale() : 1.0; }
  LossScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  // Boundaries skipped (fp16 overflows, "skip"); settled ones only, see settle().
  int64_t& skippedSteps() { return skippedSteps_; }
  // The global gradient norm before clipping, from the last step that clipped (0 before any).
  // Reading it synchronises with the device (it is kept there).
  double lastGradNorm() const { return lastGradNorm_.defined() ? lastGradNorm_.item<double>() : 0.0; }

  // The config's schedule, or nullptr without one.
  LrSchedule* schedule() { return schedule_ ? &*schedule_ : nullptr; }
  const LrSchedule* schedule() const { return schedule_ ? &*schedule_ : nullptr; }
  // Learning rates of the optimizer's groups (Engine::setLearningRate and the rest). Setting
  // one is refused while a config schedule owns the lr.
  void setLearningRate(ShardedAdamW& optimizer, double lr, int group) const;
  static double learningRate(const ShardedAdamW& optimizer, int group);
  static std::vector<double> learningRates(const ShardedAdamW& optimizer);
  static std::vector<std::pair<double, double>> betas(const ShardedAdamW& optimizer);
  // DeepSpeed's lr_scheduler.load_state_dict (settles the last step first).
  void loadScheduleState(const SteppedState& state, int64_t lastBatchIteration, int64_t boundary);
  // After a checkpoint load: the schedule's current values go back into the groups unless the
  // loaded groups came with the schedule state they belong to.
  void afterLoad(ShardedAdamW& optimizer, bool loadedWithSchedule);

 private:
  void stepBucketByBucket(const SteppedState& state);
  const at::Tensor& globalGradSquares(const SteppedState& state, Communicator& shardComm);
  // What the nonfinite check reads: the squares with clipping, else the gradients' sum.
  const at::Tensor& finiteProbe(const SteppedState& state, Communicator& shardComm);
  void clipGradients(const SteppedState& state, Communicator& shardComm);
  bool overflowed(const SteppedState& state, Communicator& shardComm);
  bool skip(const SteppedState& state);
  void finish(const SteppedState& state);
  void applySchedule(ShardedAdamW& optimizer, const std::vector<ScheduledValues>& values);
  // zeroshard.nonfinite (nonfinite_check.cpp): whether the step's gradients are all finite;
  // when not, names the first parameter that is not ("error": raises; "skip": warns).
  bool gradsFinite(const SteppedState& state, Communicator& shardComm, int64_t boundary);
  bool decideDeferred(const SteppedState& state) const;
  at::Tensor nonfiniteOnDevice(const SteppedState& state, Communicator& shardComm);

  double gradientClipping_;
  std::string nonfinite_;       // zeroshard.nonfinite: "error", "skip" or "off"
  std::string nonfiniteCheck_;  // zeroshard.nonfinite_check
  std::string schedulerType_;   // for the error of setLearningRate
  bool warns_;                  // rank 0
  std::optional<LossScaler> scaler_;
  std::optional<LrSchedule> schedule_;
  int64_t skippedSteps_ = 0;
  at::Tensor lastGradNorm_;  // 0-dim, on the parameters' device
  at::Tensor stepSquares_;   // this step's globalGradSquares(), until finish()
  at::Tensor stepSum_;       // this step's finiteProbe() without clipping, until finish()
  bool deferred_ = false;    // defersNonfiniteCheck()
  DeferredSkip deferredSkip_;  // the last step's flag, until settle()
};

} // namespace zeroshard
