// Gradient reduction at every stage, driven by autograd; which collective runs and where the
// gradients go is the gradient storage's (grad_storage.h, chosen by the sharding plan).
//
// A post-hook on each parameter's gradient accumulator reports when its gradient is final for
// this backward. When every parameter of a bucket has reported, the bucket's collective starts
// at once (asynchronously) and overlaps the rest of backward: every micro-batch when the
// storage is sharded, at the accumulation boundary when it accumulates in place.
// finishBackward() starts the buckets some of whose parameters got no gradient (in bucket
// order, identical on every rank) and waits for everything in flight.
//
// With overlap off (DeepSpeed's zero_optimization.overlap_comm = false, its default below stage
// 3) each reduction is waited for as soon as it is launched: on a CPU the hook blocks until it
// is done; on a GPU the compute stream waits for it, so the rest of backward runs after it. At
// stages 2 and 3 that keeps at most one staging buffer alive, at the cost of the overlap. With
// overlap on, at most ReductionOptions::maxInFlight reductions run at once (Note [staging
// lifetime]).
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/bucket.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace zeroshard {

class GradReducer {
 public:
  // Complete on construction: the hooks are registered. `buckets` and `grads` belong to the
  // engine and must outlive the reducer, which only reads the buckets and drives the storage.
  GradReducer(const std::vector<Bucket>& buckets, GradStorage& grads, Communicator& comm, ReductionOptions options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // `boundary`: this backward ends an accumulation window (stages 0 and 1 reduce only then).
  void beginBackward(bool boundary);
  // Blocks until every bucket's reduction of this backward has completed.
  void finishBackward();
  // After autograd failed: waits for what is in flight, starts nothing new.
  void abortBackward();
  // Called from the autograd hook of parameter `param` of bucket `bucket`.
  void onGradReady(size_t bucket, size_t param);
  // Called by the hook before AccumulateGrad: the tensor to accumulate (GradStorage::gradArriving).
  at::Tensor onGradArriving(size_t bucket, size_t param, const at::Tensor& grad);
  // Bytes of full-size buffers that exist only for a reduction (stages 2 and 3: the staging
  // buffers; stages 0 and 1 with fp32 reduction of 16-bit gradients: the fp32 copy), the most
  // alive at once since resetPeak().
  int64_t peakStagingBytes() const { return transient_.peak(); }
  void resetPeak() { transient_.resetPeak(); }

 private:
  bool reducesThisBackward() const;
  void launch(size_t bucket);
  // Waits for one reduction, runs its completion and releases what it held.
  void retire(StartedReduction& f);
  void retireCompleted();
  void retireOldest();
  void retireAll();
  void registerHooks();
  void removeHooks();

  const std::vector<Bucket>& buckets_;
  GradStorage& grads_;
  Communicator& comm_;
  bool inBackward_ = false;
  bool boundary_ = false;
  std::vector<std::vector<char>> ready_;
  std::vector<size_t> readyCount_;
  std::vector<char> launched_;
  std::vector<StartedReduction> inFlight_;
  ReductionOptions options_;
  TransientBytes transient_;
  struct HookHandle;
  std::vector<std::unique_ptr<HookHandle>> hooks_;
};

} // namespace zeroshard
