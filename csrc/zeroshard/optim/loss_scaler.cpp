#include "zeroshard/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace zeroshard {

LossScaler::LossScaler(const Fp16Config& config)
    : dynamic_(config.lossScale == 0),
      scale_(config.lossScale == 0 ? std::ldexp(1.0, static_cast<int>(config.initialScalePower)) : config.lossScale),
      minScale_(config.minLossScale),
      window_(config.lossScaleWindow),
      hysteresis_(config.hysteresis),
      hysteresisLeft_(config.hysteresis) {}

void LossScaler::update(bool overflow) {
  if (dynamic_) {
    if (overflow) {
      if (hysteresisLeft_ <= 1) {
        scale_ = std::max(scale_ / 2.0, minScale_);
      } else {
        --hysteresisLeft_;
      }
      lastOverflowIteration_ = iteration_;
    } else {
      // The window-th clean step since the last overflow (or the start) doubles, as
      // DynamicLossScaler.update_scale: (cur_iter - last_overflow_iter) % scale_window == 0.
      if ((iteration_ - lastOverflowIteration_) % window_ == 0) {
        hysteresisLeft_ = hysteresis_;
        scale_ *= 2.0;
      }
    }
  }
  ++iteration_;
}

void LossScaler::restore(const State& state) {
  scale_ = state.scale;
  hysteresisLeft_ = state.hysteresisLeft;
  iteration_ = state.iteration;
  lastOverflowIteration_ = state.lastOverflowIteration;
}

} // namespace zeroshard
