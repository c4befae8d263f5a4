#include "zeroshard/grad/host_grads.h"

#include "zeroshard/grad/grad_decorator.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "zeroshard/layout/host_memory.h"

#include <optional>
#include <utility>

namespace zeroshard {
namespace {

class HostGradShards final : public GradStorageDecorator {
 public:
  HostGradShards(std::unique_ptr<GradStorage> inner, const std::vector<Bucket>& buckets,
                 const std::vector<char>& onHost, bool pin)
      : GradStorageDecorator(std::move(inner)) {
    for (size_t i = 0; i < buckets.size(); ++i) {
      const at::Tensor grad = inner_->optimizerGrad(i);
      host_.push_back(onHost[i] ? emptyOnHost(grad.numel(), at::kFloat, pin, grad.device()) : at::Tensor());
      if (host_.back().defined()) host_.back().zero_();
    }
  }

  at::Tensor optimizerGrad(size_t index) const override {
    return host_[index].defined() ? host_[index] : inner_->optimizerGrad(index);
  }

  StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& ready, Communicator& comm,
                          const ReductionOptions& options, TransientBytes& transient) override {
    StartedReduction started = inner_->reduce(bucket, index, ready, comm, options, transient);
    if (!host_[index].defined() || !boundary_) return started;
    // The window's sum is final once this completes: copy it to the host then.
    started.then = [this, index, then = std::move(started.then)]() {
      if (then) then();
      copyToHostShard(index);
    };
    return started;
  }

  // Every host shard is overwritten at the next boundary, so zero() leaves them.
  int64_t bytes() const override { return inner_->bytes() + ownHostBytes(); }
  int64_t hostBytes() const override { return inner_->hostBytes() + ownHostBytes(); }

  void finishCopies() override {
    inner_->finishCopies();
    if (copyStream_) copyStream_->synchronize();
  }

 private:
  void copyToHostShard(size_t index) {
    const at::Tensor src = inner_->optimizerGrad(index);
    const c10::Device device = src.device();
    if (device.is_cpu()) {
      host_[index].copy_(src);
      return;
    }
    // Note [gradient copy stream]: the copy runs on a stream of its own, after what the compute
    // stream has queued so far (the reduction's completion), so backward's kernels are not
    // queued behind it. The device shard is not written again before the step, which waits
    // for this stream first.
    const c10::impl::VirtualGuardImpl impl(device.type());
    if (!copyStream_) copyStream_ = impl.getStreamFromGlobalPool(device);
    c10::Event reduced(device.type());
    reduced.record(impl.getStream(device));
    reduced.block(*copyStream_);
    const c10::StreamGuard onCopyStream(*copyStream_);
    copyBetween(host_[index], src);
  }

  int64_t ownHostBytes() const {
    int64_t total = 0;
    for (const auto& h : host_) {
      if (h.defined()) total += static_cast<int64_t>(h.nbytes());
    }
    return total;
  }

  std::vector<at::Tensor> host_;  // fp32, per bucket; undefined where the optimizer is on the device
  std::optional<c10::Stream> copyStream_;
};

}  // namespace

std::unique_ptr<GradStorage> withHostGradShards(std::unique_ptr<GradStorage> inner, const std::vector<Bucket>& buckets,
                                                const std::vector<char>& onHost, bool pin) {
  return std::make_unique<HostGradShards>(std::move(inner), buckets, onHost, pin);
}

}  // namespace zeroshard
