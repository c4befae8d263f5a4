// A gradient storage that adds one thing to another (grad_storage.h): it hands every call to
// the storage it wraps, and remembers whether the backward in progress ends the accumulation
// window. The offload's host shards (host_grads.h) and hybrid sharding's all-reduce across the
// shard groups (replica_reduce.h) are such additions, and compose: each wraps the one before.
#pragma once

#include "zeroshard/grad/grad_storage.h"

#include <memory>
#include <utility>

namespace zeroshard {

class GradStorageDecorator : public GradStorage {
 public:
  explicit GradStorageDecorator(std::unique_ptr<GradStorage> inner) : inner_(std::move(inner)) {}

  bool accumulatesInPlace() const override { return inner_->accumulatesInPlace(); }
  at::Tensor optimizerGrad(size_t index) const override { return inner_->optimizerGrad(index); }
  void beginBackward(const Bucket& bucket, size_t index, bool boundary) override {
    boundary_ = boundary;
    inner_->beginBackward(bucket, index, boundary);
  }
  at::Tensor gradArriving(const Bucket& bucket, size_t index, size_t param, const at::Tensor& grad) override {
    return inner_->gradArriving(bucket, index, param, grad);
  }
  void gradReady(const Bucket& bucket, size_t index, size_t param, TransientBytes& transient) override {
    inner_->gradReady(bucket, index, param, transient);
  }
  StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& ready, Communicator& comm,
                          const ReductionOptions& options, TransientBytes& transient) override {
    return inner_->reduce(bucket, index, ready, comm, options, transient);
  }
  void zero() override { inner_->zero(); }
  int64_t bytes() const override { return inner_->bytes(); }
  int64_t hostBytes() const override { return inner_->hostBytes(); }
  void finishCopies() override { inner_->finishCopies(); }

 protected:
  std::unique_ptr<GradStorage> inner_;
  bool boundary_ = false;  // the backward in progress ends the accumulation window
};

}  // namespace zeroshard
