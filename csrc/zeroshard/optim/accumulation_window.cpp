#include "zeroshard/optim/accumulation_window.h"

#include <c10/util/Exception.h>

namespace zeroshard {

AccumulationWindow::AccumulationWindow(int64_t steps) : steps_(steps) {
  TORCH_CHECK(steps >= 1, "zeroshard: gradient_accumulation_steps must be at least 1, got ", steps);
}

bool AccumulationWindow::isBoundary() const {
  if (decided_) return *decided_;
  if (override_) return *override_;
  // ">=": a window kept open past its length by an override of false ends at the first
  // micro-step counted again.
  return inWindow_ + 1 >= steps_;
}

void AccumulationWindow::recordBackward(bool boundary) {
  decided_ = boundary;
}

bool AccumulationWindow::finishMicroStep() {
  TORCH_CHECK(decided_, "zeroshard: engine.step() called without engine.backward() since the last step; call "
                        "engine.backward(loss) after each forward, then engine.step()");
  const bool boundary = *decided_;
  decided_.reset();
  ++microSteps_;
  if (boundary) {
    ++boundaries_;
    inWindow_ = 0;
  } else {
    ++inWindow_;
  }
  return boundary;
}

void AccumulationWindow::restore(int64_t boundaries) {
  boundaries_ = boundaries;
  microSteps_ = boundaries * steps_;
  inWindow_ = 0;
  decided_.reset();
}

} // namespace zeroshard
