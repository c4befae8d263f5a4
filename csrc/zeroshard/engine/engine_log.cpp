// The engine's progress line (step_log.h): what it reads at a print step, and the device
// synchronisation wall_clock_breakdown times with.
#include "zeroshard/engine/engine.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace zeroshard {

void Engine::setLogSink(std::function<void(const std::string&)> sink) {
  stepLog_.setSink(std::move(sink));
}

void Engine::beginForward() {
  stepLog_.begin(StepPhase::kForward);
}

void Engine::endForward() {
  stepLog_.end(StepPhase::kForward);
}

void Engine::logBoundary() {
  const int64_t boundaries = window_.boundaries();
  // The line reports skipped steps and the lr: the deferred nonfinite check's flag is read first,
  // on every rank (in "error" mode they all raise here, none waits in a collective for another).
  if (boundaries % config_.stepsPerPrint == 0) settleLastStep("at the log line of step " + std::to_string(boundaries));
  if (!stepLog_.boundary(boundaries)) return;
  StepLogLine line;
  line.step = boundaries;
  line.skipped = skippedSteps_;
  line.lrs = learningRates();
  line.lossScale = lossScale();
  // The one read of the loss, on print steps only (a device synchronisation on a GPU).
  if (lastLoss_.defined()) line.loss = lastLoss_.item<double>();
  stepLog_.print(std::move(line), batchSizes_.train);
}

void Engine::syncComputeDevice() {
  if (buckets_.empty()) return;
  const c10::Device device = buckets_.front().flatParams().device();
  if (device.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

} // namespace zeroshard
