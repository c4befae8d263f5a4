// Where gradients live, chosen by the sharding plan. The storage owns every gradient buffer;
// the reducer drives it through a backward, the engine hands its tensors to the optimizer.
//
//   full (gradients replicated: stages 0 and 1): per bucket one flat buffer in the compute
//     dtype whose views are the parameters' .grad, so autograd accumulates straight into it over
//     the micro-batches of a window; it is reduced at the accumulation boundary, all-reduced
//     (stage 0) or reduce-scattered into this rank's slice (stage 1; 16-bit gradients reduced in
//     fp32 go into a separate fp32 shard).
//   sharded (stages 2 and 3): per bucket this rank's gradient shard, accumulated across
//     micro-batches. Each micro-batch's gradients are copied, as each becomes final, into a
//     full-size staging buffer that exists only until the bucket's reduce-scatter completes.
//
// offloaded (grad/host_grads.h): either of them, plus an fp32 copy of each offloaded bucket's
//   gradient shard in host memory, copied there as the reduction that ends the window finishes;
//   the optimizer steps those buckets on the host from it.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/plan/sharding_plan.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace zeroshard {

// Bytes of buffers that exist only for a reduction (staging buffers, fp32 copies of 16-bit
// gradients): how many are alive, and the most alive at once since resetPeak().
class TransientBytes {
 public:
  void add(int64_t bytes);
  int64_t peak() const { return peak_; }
  void resetPeak() { peak_ = live_; }

 private:
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

struct ReductionOptions {
  // Divide gradients by the world size before summing them (fp16), instead of after.
  bool preDivide = false;
  // Reduce 16-bit gradients in float32 (zeroshard.reduce_dtype = "fp32").
  bool reduceInFloat = false;
  // Overlap reductions with the rest of backward (true), or wait for each as it is launched.
  bool overlap = true;
  // With overlap: the most reductions in flight; launching one more first waits for the oldest.
  int64_t maxInFlight = 2;
  // Stage 3: told each time a bucket's reduce-scatter has started (its parameters can go).
  std::function<void(size_t)> onLaunched;
};

// A reduction a storage started: `then` runs once it has completed (it holds the buffers the
// collective reads or writes); `transientBytes` are released then.
struct StartedReduction {
  CommHandle handle;
  std::function<void()> then;
  int64_t transientBytes = 0;
  size_t bucket = 0;  // set by the GradReducer that launched it, for its errors
};

struct GradStorageOptions {
  at::ScalarType computeDtype = at::kFloat;
  int64_t accumulationSteps = 1;
  bool reduceInFloat = false;
};

class GradStorage {
 public:
  // The storage the plan asks for, with empty (zero) gradients for every bucket.
  // `replicate` (hybrid sharding): the ranks holding the same shards in the other shard groups;
  // the window's sum of each shard is all-reduced over them (grad/host_grads.h).
  static std::unique_ptr<GradStorage> forPlan(const ShardingPlan& plan, const std::vector<Bucket>& buckets,
                                              int rank, const GradStorageOptions& options,
                                              Communicator* replicate = nullptr);
  virtual ~GradStorage() = default;

  // true: autograd accumulates into the storage and a bucket is reduced at the accumulation
  // boundary only (full); false: every micro-batch's gradients are reduced as they are final.
  virtual bool accumulatesInPlace() const = 0;
  // The gradients the optimizer reads for bucket `index`, over the range its master weights
  // cover (the whole buffer, or this rank's shard).
  virtual at::Tensor optimizerGrad(size_t index) const = 0;

  // A backward starts (full: every parameter that has a gradient in this window has its view as
  // .grad again, after a user set it to None); `boundary`: it ends the accumulation window.
  virtual void beginBackward(const Bucket& bucket, size_t index, bool boundary) {}
  // Parameter `param`'s gradient `grad` is about to be accumulated into its .grad: returns the
  // tensor to accumulate instead (full: the window's first gradient, copied into the parameter's
  // view of the flat buffer, Note [first gradient of a window]).
  virtual at::Tensor gradArriving(const Bucket& bucket, size_t index, size_t param, const at::Tensor& grad) {
    return grad;
  }
  // Parameter `param` of the bucket has its final gradient for this backward (sharded: it goes
  // into the staging buffer and .grad is freed).
  virtual void gradReady(const Bucket& bucket, size_t index, size_t param, TransientBytes& transient) {}
  // Starts the bucket's reduction. ready[i]: parameter i got a gradient in this backward.
  virtual StartedReduction reduce(const Bucket& bucket, size_t index, const std::vector<char>& ready,
                                  Communicator& comm, const ReductionOptions& options, TransientBytes& transient) = 0;
  // After an optimizer step: the next window starts from no gradient, and nothing has been
  // reduced into a shard. The buffers are not written here: the window's first gradient or
  // reduction overwrites them, and finishCopies() zeroes those nothing wrote (full: every .grad
  // is None until its parameter's next gradient, as after torch's zero_grad()).
  virtual void zero() = 0;
  // Bytes of gradients held between steps (not the transient ones), and of those in host memory.
  virtual int64_t bytes() const = 0;
  virtual int64_t hostBytes() const { return 0; }
  // Before the optimizer reads optimizerGrad(): every copy into host memory has finished, and a
  // buffer no reduction wrote since zero() reads as zero.
  virtual void finishCopies() {}
};

} // namespace zeroshard
