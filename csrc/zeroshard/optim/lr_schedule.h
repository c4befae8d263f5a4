// DeepSpeed's five learning-rate schedules (deepspeed/runtime/lr_schedules.py: LRRangeTest,
// OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR), from the config's "scheduler" section,
// as pure arithmetic: no torch, so it compiles in seconds and the engine applies the values.
//
// Note [schedule semantics]: as in DeepSpeed, a schedule is a function of last_batch_iteration
// (the param of that name, -1 by default), and the engine steps it once per optimizer step
// taken, right after that step (never on an fp16 step skipped for an overflow):
//   - constructed at iteration -1, it puts its start values into the param groups, so the
//     first optimizer step uses them (WarmupLR: warmup_min_lr; WarmupCosineLR: 0; OneCycle:
//     cycle_min_lr and betas (cycle_min_mom, 0.99));
//   - step() adds 1 to the iteration and puts the formula's values at the new iteration into
//     the groups, for the next optimizer step: from -1, optimizer step n (counting from 1) uses
//     the values at iteration n - 2, the start values for n = 1;
//   - constructed at another iteration (a resumed run written into the config), it sets
//     nothing until its first step(), as DeepSpeed's classes do: the groups keep their lr.
// So with WarmupLR or WarmupDecayLR and warmup_type "log", the first two optimizer steps use
// warmup_min_lr (iteration -1, then log(0 + 1) = 0 at iteration 0).
//
// DeepSpeed's quirks are kept on purpose, so that a DeepSpeed config trains the same numbers:
//   - warm-ups clamp warmup_num_steps to at least 2 (log(1) would divide by zero);
//   - OneCycle with cycle_momentum (its default) sets each group's betas to (momentum, 0.99):
//     beta2 becomes 0.99 whatever the optimizer's was; and it starts at cycle_min_mom although
//     the formula at iteration -1 gives cycle_max_mom;
//   - WarmupLR without warmup_max_lr warms up to each group's own lr; WarmupCosineLR's ratios
//     multiply each group's lr as it was before the schedule touched it.
// Every value is computed in double in the order DeepSpeed's Python computes it, so the lr
// sequences are bitwise DeepSpeed's (tests/python/test_lr_schedule.py holds that).
#pragma once

#include "zeroshard/config/config.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard {

// What a schedule sets in one param group: its lr, and with OneCycle's cycle_momentum its
// AdamW betas (beta1 the cycled momentum, beta2 DeepSpeed's 0.99).
struct ScheduledValues {
  double lr = 0;
  std::optional<double> beta1;
  std::optional<double> beta2;
};

class LrSchedule {
 public:
  // `baseLrs`: each param group's lr before the schedule sets anything (the optimizer's lr
  // or the group's own). Throws std::invalid_argument naming the key for values DeepSpeed's
  // classes refuse (a zero step size, a missing required key, an unknown type).
  LrSchedule(const SchedulerConfig& config, std::vector<double> baseLrs);

  const std::string& type() const { return type_; }
  int numGroups() const { return static_cast<int>(baseLrs_.size()); }
  int64_t lastBatchIteration() const { return iteration_; }

  // The values the groups should hold now: the start values at construction (none when
  // constructed at an iteration other than -1, Note [schedule semantics]), then those of the
  // last step() or restore().
  const std::optional<std::vector<ScheduledValues>>& current() const { return current_; }
  // Adds 1 to last_batch_iteration; returns the values at it (current() from now on).
  const std::vector<ScheduledValues>& step();
  // The state DeepSpeed's state_dict() holds: last_batch_iteration. current() becomes the
  // values at it (the start values at -1).
  void restore(int64_t lastBatchIteration);
  // Undoes the last step(): last_batch_iteration and current() are again what they were before
  // it. The engine takes back a step it learns only at the next boundary was skipped on the
  // device (Note [deferred nonfinite check] in nonfinite_check.cpp), before stepping again, so
  // one level is kept; throws std::logic_error when there is no step() to undo (none since
  // construction, restore() or the last rewind()).
  void rewind();

  // The formula at `iteration` (DeepSpeed's get_lr() and get_mom() there), per group.
  std::vector<ScheduledValues> valuesAt(int64_t iteration) const;

 private:
  enum class Kind { kRangeTest, kOneCycle, kWarmup, kWarmupDecay, kWarmupCosine };
  std::vector<ScheduledValues> startValues() const;
  double rangeTestLr(int64_t iteration) const;
  double oneCycleScale(int64_t iteration) const;
  ScheduledValues oneCycleValues(int64_t iteration) const;
  double warmupGamma(int64_t iteration) const;
  double cosineRatio(int64_t iteration) const;

  std::string type_;
  Kind kind_ = Kind::kWarmup;
  std::vector<double> baseLrs_;
  int64_t iteration_ = -1;
  std::optional<std::vector<ScheduledValues>> current_;
  // Before the last step(), for rewind(): last_batch_iteration and current().
  struct Before {
    int64_t iteration;
    std::optional<std::vector<ScheduledValues>> current;
  };
  std::optional<Before> beforeStep_;

  // LRRangeTest
  double minLr_ = 0;
  int64_t stepSize_ = 1;
  double stepRate_ = 0;
  bool staircase_ = false;
  // OneCycle (sizes as DeepSpeed keeps them: floats)
  double cycleMinLr_ = 0, cycleMaxLr_ = 0, decayLrRate_ = 0;
  double firstStepSize_ = 0, secondStepSize_ = 0, totalSize_ = 0, stepRatio_ = 0;
  int64_t firstStairCount_ = 0, secondStairCount_ = 0, decayStepSize_ = 0;
  bool cycleMomentum_ = false, skipLrDecay_ = true, skipMomDecay_ = true;
  double minMom_ = 0, maxMom_ = 0, decayMomRate_ = 0;
  // WarmupLR, WarmupDecayLR (per group), WarmupCosineLR
  std::vector<double> warmupMinLrs_, warmupMaxLrs_;
  int64_t warmupNumSteps_ = 2;
  bool linearWarmup_ = false;
  double inverseLogWarmup_ = 0;
  int64_t totalNumSteps_ = 0;
  double warmupMinRatio_ = 0, cosMinRatio_ = 0;
};

} // namespace zeroshard
