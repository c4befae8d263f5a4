#include "zeroshard/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <utility>

// Note [DeepSpeed's arithmetic]: each formula below is written in the order of operations of
// deepspeed/runtime/lr_schedules.py, in double (Python's float), with the same integer/float
// conversions (an int divided by an int there is a correctly rounded double division here), so
// that the values are bitwise DeepSpeed's. Do not "simplify" them: (a - b) * s + b is not
// a + (b - a) * s in floating point. This file must not be compiled with FMA contraction
// (-ffp-contract=fast together with -mfma); the default x86-64 flags do not contract.

namespace zeroshard {
namespace {

constexpr double kPi = 3.141592653589793;  // Python's math.pi
constexpr double kOneCycleBeta2 = 0.99;    // DeepSpeed's OneCycle sets betas (momentum, 0.99)

std::string where(const SchedulerConfig& config, const std::string& key) {
  return "zeroshard: scheduler " + config.type + ": scheduler.params." + key;
}

double number(const SchedulerConfig& config, const std::string& key) {
  try {
    return config.param(key);
  } catch (const std::out_of_range&) {
    throw std::invalid_argument(where(config, key) + " is required (DeepSpeed's " + config.type +
                                " has no default for it)");
  }
}

int64_t steps(const SchedulerConfig& config, const std::string& key) {
  return static_cast<int64_t>(number(config, key));
}

// warmup_num_steps of the warm-ups: DeepSpeed refuses 0 and then clamps to at least 2.
int64_t warmupSteps(const SchedulerConfig& config) {
  const int64_t n = steps(config, "warmup_num_steps");
  if (n <= 0) {
    throw std::invalid_argument(where(config, "warmup_num_steps") + " must be a positive integer, got " +
                                std::to_string(n));
  }
  return std::max<int64_t>(2, n);
}

bool linearWarmup(const SchedulerConfig& config) {
  if (config.warmupType == "log") return false;
  if (config.warmupType == "linear") return true;
  throw std::invalid_argument(where(config, "warmup_type") + " is \"" + config.warmupType +
                              "\"; use \"log\" or \"linear\"");
}

} // namespace

LrSchedule::LrSchedule(const SchedulerConfig& config, std::vector<double> baseLrs)
    : type_(config.type), baseLrs_(std::move(baseLrs)) {
  static const std::map<std::string, Kind> kinds = {{"LRRangeTest", Kind::kRangeTest},
                                                     {"OneCycle", Kind::kOneCycle},
                                                     {"WarmupLR", Kind::kWarmup},
                                                     {"WarmupDecayLR", Kind::kWarmupDecay},
                                                     {"WarmupCosineLR", Kind::kWarmupCosine}};
  const auto kind = kinds.find(type_);
  if (kind == kinds.end()) {
    throw std::invalid_argument("zeroshard: scheduler.type \"" + type_ +
                                "\" is not one of LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR");
  }
  kind_ = kind->second;
  if (baseLrs_.empty()) throw std::invalid_argument("zeroshard: scheduler " + type_ + ": no param groups to schedule");
  iteration_ = steps(config, "last_batch_iteration");
  if (iteration_ < -1) {
    throw std::invalid_argument(where(config, "last_batch_iteration") + " must be -1 or more, got " +
                                std::to_string(iteration_));
  }
  const size_t groups = baseLrs_.size();
  if (kind_ == Kind::kRangeTest) {
    minLr_ = number(config, "lr_range_test_min_lr");
    stepSize_ = steps(config, "lr_range_test_step_size");
    if (stepSize_ <= 0) {
      throw std::invalid_argument(where(config, "lr_range_test_step_size") + " must be a positive integer, got " +
                                  std::to_string(stepSize_));
    }
    stepRate_ = number(config, "lr_range_test_step_rate");
    staircase_ = number(config, "lr_range_test_staircase") != 0;
  } else if (kind_ == Kind::kOneCycle) {
    cycleMinLr_ = number(config, "cycle_min_lr");
    cycleMaxLr_ = number(config, "cycle_max_lr");
    decayLrRate_ = number(config, "decay_lr_rate");
    firstStepSize_ = static_cast<double>(steps(config, "cycle_first_step_size"));
    if (firstStepSize_ <= 0) {
      throw std::invalid_argument(where(config, "cycle_first_step_size") + " must be positive");
    }
    // None (absent or null): the same as the first half, for the step size and the stair count.
    secondStepSize_ = config.has("cycle_second_step_size")
                          ? static_cast<double>(steps(config, "cycle_second_step_size"))
                          : firstStepSize_;
    totalSize_ = firstStepSize_ + secondStepSize_;
    stepRatio_ = firstStepSize_ / totalSize_;
    firstStairCount_ = steps(config, "cycle_first_stair_count");
    secondStairCount_ =
        config.has("cycle_second_stair_count") ? steps(config, "cycle_second_stair_count") : firstStairCount_;
    decayStepSize_ = steps(config, "decay_step_size");
    cycleMomentum_ = number(config, "cycle_momentum") != 0;
    minMom_ = number(config, "cycle_min_mom");
    maxMom_ = number(config, "cycle_max_mom");
    decayMomRate_ = number(config, "decay_mom_rate");
    // DeepSpeed skips a decay when decay_step_size or its rate is (exactly) 0.
    skipLrDecay_ = decayStepSize_ == 0 || decayLrRate_ == 0;
    skipMomDecay_ = decayStepSize_ == 0 || decayMomRate_ == 0;
  } else if (kind_ == Kind::kWarmup || kind_ == Kind::kWarmupDecay) {
    warmupNumSteps_ = warmupSteps(config);
    warmupMinLrs_.assign(groups, number(config, "warmup_min_lr"));
    // WarmupLR's warmup_max_lr defaults to None, each group's own lr; WarmupDecayLR's to 0.001.
    if (kind_ == Kind::kWarmup && !config.has("warmup_max_lr")) {
      warmupMaxLrs_ = baseLrs_;
    } else {
      warmupMaxLrs_.assign(groups, number(config, "warmup_max_lr"));
    }
    linearWarmup_ = linearWarmup(config);
    if (kind_ == Kind::kWarmupDecay) totalNumSteps_ = steps(config, "total_num_steps");
  } else {  // kWarmupCosine
    totalNumSteps_ = steps(config, "total_num_steps");
    warmupMinRatio_ = number(config, "warmup_min_ratio");
    warmupNumSteps_ = warmupSteps(config);
    cosMinRatio_ = number(config, "cos_min_ratio");
    linearWarmup_ = linearWarmup(config);
  }
  inverseLogWarmup_ = 1.0 / std::log(static_cast<double>(warmupNumSteps_));
  if (iteration_ == -1) current_ = startValues();
}

const std::vector<ScheduledValues>& LrSchedule::step() {
  beforeStep_ = Before{iteration_, current_};
  ++iteration_;
  current_ = valuesAt(iteration_);
  return *current_;
}

void LrSchedule::restore(int64_t lastBatchIteration) {
  if (lastBatchIteration < -1) {
    throw std::invalid_argument("zeroshard: scheduler " + type_ + ": last_batch_iteration must be -1 or more, got " +
                                std::to_string(lastBatchIteration));
  }
  iteration_ = lastBatchIteration;
  current_ = iteration_ == -1 ? startValues() : valuesAt(iteration_);
  beforeStep_.reset();
}

void LrSchedule::rewind() {
  if (!beforeStep_) {
    throw std::logic_error("zeroshard: scheduler " + type_ + ": rewind() without a step() to undo");
  }
  iteration_ = beforeStep_->iteration;
  current_ = std::move(beforeStep_->current);
  beforeStep_.reset();
}

std::vector<ScheduledValues> LrSchedule::startValues() const {
  std::vector<ScheduledValues> out(baseLrs_.size());
  for (size_t g = 0; g < out.size(); ++g) {
    switch (kind_) {
      case Kind::kRangeTest:
        out[g].lr = minLr_;
        break;
      case Kind::kOneCycle:
        out[g].lr = cycleMinLr_;
        if (cycleMomentum_) {
          out[g].beta1 = minMom_;
          out[g].beta2 = kOneCycleBeta2;
        }
        break;
      case Kind::kWarmup:
      case Kind::kWarmupDecay:
        out[g].lr = warmupMinLrs_[g];
        break;
      case Kind::kWarmupCosine:
        out[g].lr = 0.0;
        break;
    }
  }
  return out;
}

std::vector<ScheduledValues> LrSchedule::valuesAt(int64_t iteration) const {
  std::vector<ScheduledValues> out(baseLrs_.size());
  for (size_t g = 0; g < out.size(); ++g) {
    switch (kind_) {
      case Kind::kRangeTest:
        out[g].lr = rangeTestLr(iteration);
        break;
      case Kind::kOneCycle:
        out[g] = oneCycleValues(iteration);
        break;
      case Kind::kWarmup:
      case Kind::kWarmupDecay:
        if (iteration < 0) {
          out[g].lr = warmupMinLrs_[g];
        } else {
          const double delta = warmupMaxLrs_[g] - warmupMinLrs_[g];
          out[g].lr = warmupMinLrs_[g] + (delta * warmupGamma(iteration));
        }
        break;
      case Kind::kWarmupCosine:
        out[g].lr = iteration < 0 ? 0.0 : baseLrs_[g] * cosineRatio(iteration);
        break;
    }
  }
  return out;
}

double LrSchedule::rangeTestLr(int64_t iteration) const {
  const double next = static_cast<double>(iteration + 1) / static_cast<double>(stepSize_);
  const double interval = staircase_ ? std::floor(next) : next;
  return minLr_ * (1 + stepRate_ * interval);
}

double LrSchedule::oneCycleScale(int64_t iteration) const {
  const double batch = static_cast<double>(iteration + 1);
  const double cycle = std::floor(1 + batch / totalSize_);
  const double x = 1. + batch / totalSize_ - cycle;
  double scale = 0;
  int64_t stairs = 0;
  if (x <= stepRatio_) {
    scale = x / stepRatio_;
    stairs = firstStairCount_;
  } else {
    scale = (x - 1) / (stepRatio_ - 1);
    stairs = secondStairCount_;
  }
  // Stairs are counted from the whole batch offset in the cycle, as DeepSpeed does: the
  // float scale at a half-cycle boundary may fall just below a stair.
  if (stairs > 0) {
    const double inCycle = std::fmod(batch, totalSize_);
    const double position = inCycle <= firstStepSize_
                                ? inCycle * static_cast<double>(stairs) / firstStepSize_
                                : (totalSize_ - inCycle) * static_cast<double>(stairs) / secondStepSize_;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

ScheduledValues LrSchedule::oneCycleValues(int64_t iteration) const {
  ScheduledValues v;
  double momentum = 0;
  if (static_cast<double>(iteration) < totalSize_) {
    const double scale = oneCycleScale(iteration);
    v.lr = cycleMinLr_ + (cycleMaxLr_ - cycleMinLr_) * scale;
    momentum = maxMom_ - (maxMom_ - minMom_) * scale;
  } else {
    const double decayIteration = static_cast<double>(iteration) - totalSize_ + 1;
    const double interval = decayIteration / static_cast<double>(decayStepSize_);
    v.lr = skipLrDecay_ ? cycleMinLr_ : cycleMinLr_ / (1 + decayLrRate_ * interval);
    momentum = skipMomDecay_ ? maxMom_ : maxMom_ * (1 + decayMomRate_ * interval);
  }
  if (cycleMomentum_) {
    v.beta1 = momentum;
    v.beta2 = kOneCycleBeta2;
  }
  return v;
}

double LrSchedule::warmupGamma(int64_t iteration) const {
  if (iteration < warmupNumSteps_) {
    return linearWarmup_ ? static_cast<double>(iteration) / static_cast<double>(warmupNumSteps_)
                         : inverseLogWarmup_ * std::log(static_cast<double>(iteration + 1));
  }
  if (kind_ == Kind::kWarmup) return 1.0;
  return std::max(0.0, static_cast<double>(totalNumSteps_ - iteration) /
                           std::max(1.0, static_cast<double>(totalNumSteps_ - warmupNumSteps_)));
}

double LrSchedule::cosineRatio(int64_t iteration) const {
  if (iteration < warmupNumSteps_) {
    const double ratio = linearWarmup_ ? static_cast<double>(iteration) / static_cast<double>(warmupNumSteps_)
                                       : inverseLogWarmup_ * std::log(static_cast<double>(iteration + 1));
    return warmupMinRatio_ + ratio * (1. - warmupMinRatio_);
  }
  const int64_t realLastStep = iteration - warmupNumSteps_ + 1;
  const int64_t realTotalSteps = std::max<int64_t>(1, totalNumSteps_ - warmupNumSteps_);
  const double progress = std::min(1.0, static_cast<double>(realLastStep) / static_cast<double>(realTotalSteps));
  const double ratio = (1 + std::cos(kPi * progress)) / 2;
  return std::max(0.0, cosMinRatio_ + (1. - cosMinRatio_) * ratio);
}

} // namespace zeroshard
