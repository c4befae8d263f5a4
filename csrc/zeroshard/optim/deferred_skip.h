// A step the optimizer kernel may have skipped on the device, which the host learns of later
// (zeroshard.nonfinite_check "deferred", Note [deferred nonfinite check] in nonfinite_check.cpp).
// The step's found-inf flag is brought to the host without blocking when it is recorded; it is
// read at the next boundary (or log line, checkpoint save, explicit check), and a step found
// skipped is then taken back where the host counted it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include "zeroshard/optim/optimizer.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace zeroshard {

class LrSchedule;

class DeferredSkip {
 public:
  // After optimizer step number `step` was given `found` as its found_inf (ShardedAdamW::step):
  // keeps the step's number and the hyper-parameters it used (call it before a schedule moves
  // them), and starts the flag's way to the host. Does not block: a CPU flag is kept as it is;
  // a device flag is copied into pinned host memory on the device's current stream, after the
  // step's kernels, and an event is recorded after the copy. The previous flag must have been
  // settled.
  void record(const at::Tensor& found, int64_t step, const ShardedAdamW& optimizer);
  bool pending() const { return pending_; }
  // The recorded step's number when its flag is set, after taking the step back: the host
  // step count of `optimizer`, and with a `schedule` its last step (rewind) and every group's
  // hyper-parameters (those the skipped step used, which the next one uses as it would have
  // had the step been skipped at once). nullopt when the step stood, or nothing is pending.
  // Blocks until the flag is on the host: on a device it waits on the event, which at the next
  // boundary is a step old (rarely a wait at all).
  std::optional<int64_t> settle(ShardedAdamW& optimizer, LrSchedule* schedule);

 private:
  bool readFlag();

  bool pending_ = false;
  int64_t step_ = 0;
  std::vector<AdamWHyper> hyperUsed_;
  at::Tensor flag_;     // a CPU flag, or the device flag's host copy (pinned, reused every step)
  at::Tensor onHost_;   // the pinned buffer, allocated at the first device flag
  std::optional<c10::Event> copied_;  // device flags: recorded after the copy into onHost_
};

} // namespace zeroshard
