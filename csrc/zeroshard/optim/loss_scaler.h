// fp16 loss scaling with DeepSpeed's keys and meanings.
//
// Dynamic (fp16.loss_scale = 0): the scale starts at 2^initial_scale_power. An overflow (an
// inf/NaN in any rank's gradients) skips the step; after `hysteresis` overflows the scale is
// divided by 2 (never below min_loss_scale), and the hysteresis budget is restored when the
// scale next grows. After loss_scale_window steps without overflow the scale doubles. This is
// DeepSpeed's DynamicLossScaler (consecutive_hysteresis = false), step for step.
// Static (fp16.loss_scale > 0): the scale never changes; an overflow still skips the step.
#pragma once

#include "zeroshard/config/config.h"

#include <cstdint>

namespace zeroshard {

class LossScaler {
 public:
  explicit LossScaler(const Fp16Config& config);

  double scale() const { return scale_; }
  // Called once per optimizer boundary with whether any rank overflowed.
  void update(bool overflow);

  // The whole state, so a checkpoint can restore it.
  struct State {
    double scale;
    int64_t hysteresisLeft;
    int64_t iteration;
    int64_t lastOverflowIteration;
  };
  State state() const { return {scale_, hysteresisLeft_, iteration_, lastOverflowIteration_}; }
  void restore(const State& state);

 private:
  bool dynamic_;
  double scale_;
  double minScale_;
  int64_t window_;
  int64_t hysteresis_;
  int64_t hysteresisLeft_;
  int64_t iteration_ = 0;
  int64_t lastOverflowIteration_ = -1;
};

} // namespace zeroshard
