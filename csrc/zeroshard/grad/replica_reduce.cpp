#include "zeroshard/grad/replica_reduce.h"

#include "zeroshard/grad/grad_decorator.h"

#include <utility>

namespace zeroshard {
namespace {

class ReplicaAllReduce final : public GradStorageDecorator {
 public:
  ReplicaAllReduce(std::unique_ptr<GradStorage> inner, Communicator& replicate)
      : GradStorageDecorator(std::move(inner)), replicate_(replicate) {}

  StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& ready, Communicator& comm,
                          const ReductionOptions& options, TransientBytes& transient) override {
    StartedReduction started = inner_->reduce(bucket, index, ready, comm, options, transient);
    if (!boundary_) return started;
    // The shard holds this group's sum of the window once the group's reduction completes (its
    // own completion runs first); the copies across groups are then summed and averaged. With
    // preDivide (fp16) each copy is divided first, as the group's reduction did.
    started.then = [this, index, preDivide = options.preDivide, then = std::move(started.then)]() {
      if (then) then();
      const at::Tensor shard = inner_->optimizerGrad(index);
      const double mean = 1.0 / replicate_.worldSize();
      if (preDivide) shard.mul_(mean);
      replicate_.allReduce(shard, preDivide ? 1.0 : mean).wait();
    };
    return started;
  }

 private:
  Communicator& replicate_;
};

}  // namespace

std::unique_ptr<GradStorage> withReplicaAllReduce(std::unique_ptr<GradStorage> inner, Communicator& replicate) {
  return std::make_unique<ReplicaAllReduce>(std::move(inner), replicate);
}

}  // namespace zeroshard
