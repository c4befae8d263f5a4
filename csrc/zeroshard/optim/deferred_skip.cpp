#include "zeroshard/optim/deferred_skip.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "zeroshard/optim/lr_schedule.h"

#include <utility>

namespace zeroshard {

void DeferredSkip::record(const at::Tensor& found, int64_t step, const ShardedAdamW& optimizer) {
  TORCH_INTERNAL_ASSERT(!pending_, "DeferredSkip::record: the previous step's flag was not settled");
  TORCH_INTERNAL_ASSERT(found.scalar_type() == at::kFloat && found.numel() == 1);
  step_ = step;
  hyperUsed_.clear();
  for (int g = 0; g < optimizer.numGroups(); ++g) hyperUsed_.push_back(optimizer.hyper(g));
  pending_ = true;
  if (found.device().is_cpu()) {
    flag_ = found;
    return;
  }
  // Not flag_.copy_(found) blocking, nor found.item(): either waits for the whole queue of the
  // stream, the synchronisation this check exists to avoid. The copy into pinned memory runs
  // in stream order after the step's kernels; the event says when it is done.
  const c10::Device device = found.device();
  if (!onHost_.defined()) {
    onHost_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(true));
  }
  onHost_.copy_(found, /*non_blocking=*/true);
  if (!copied_ || copied_->device_type() != device.type()) copied_.emplace(device.type());
  copied_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  flag_ = onHost_;
}

bool DeferredSkip::readFlag() {
  if (copied_ && flag_.is_same(onHost_)) copied_->synchronize();  // a step old at the next boundary
  return flag_.item<float>() != 0.0f;
}

std::optional<int64_t> DeferredSkip::settle(ShardedAdamW& optimizer, LrSchedule* schedule) {
  if (!pending_) return std::nullopt;
  pending_ = false;
  const bool skipped = readFlag();
  flag_ = at::Tensor();
  if (!skipped) return std::nullopt;
  optimizer.takeBackStep();
  if (schedule != nullptr) {
    schedule->rewind();
    // The schedule stepped after the skipped step and wrote its next values into the groups;
    // the skipped step's own values are what they hold when a step is skipped at once.
    for (int g = 0; g < optimizer.numGroups() && g < static_cast<int>(hyperUsed_.size()); ++g) {
      optimizer.hyper(g) = hyperUsed_[g];
    }
  }
  return step_;
}

} // namespace zeroshard
