// Gradient reduction at every stage, driven by autograd; what it does follows the sharding plan.
//
// A post-hook on each parameter's gradient accumulator reports when its gradient is final for
// this backward. When every parameter of a bucket has reported, the bucket's collective starts
// at once (asynchronously) and overlaps the rest of backward:
//   stage 0: all-reduce of the full flat gradients, at the accumulation boundary;
//   stage 1: reduce-scatter of the full flat gradients into this rank's slice, at the boundary
//            (16-bit gradients summed in fp32: into the bucket's fp32 gradient shard);
//   stages 2 and 3: every micro-batch, the bucket's gradients are copied into a full-size staging
//            buffer, reduce-scattered, added to the fp32 gradient shard, and the staging
//            buffer is released.
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

#include "zeroshard/layout/bucket.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/plan/sharding_plan.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace zeroshard {

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

class GradReducer {
 public:
  GradReducer(std::vector<Bucket>& buckets, Communicator& comm, const ShardingPlan& plan, ReductionOptions options);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // `boundary`: this backward ends an accumulation window (stages 0 and 1 reduce only then).
  void beginBackward(bool boundary);
  // Blocks until every bucket's reduction of this backward has completed.
  void finishBackward();
  // After autograd failed: waits for what is in flight, starts nothing new.
  void abortBackward();
  // Stage 2: the gradient shards hold nothing yet (after the optimizer step zeroed them).
  void markShardsEmpty();

  // Called from the autograd hook of parameter `param` of bucket `bucket`.
  void onGradReady(size_t bucket, size_t param);
  // Bytes of full-size buffers that exist only for a reduction (stages 2 and 3: the staging
  // buffers; stages 0 and 1 with fp32 reduction of 16-bit gradients: the fp32 copy), the most
  // alive at once since resetPeak().
  int64_t peakStagingBytes() const { return peakStagingBytes_; }
  void resetPeak() { peakStagingBytes_ = liveStagingBytes_; }

 private:
  struct InFlight {
    CommHandle handle;
    std::function<void()> then;
    int64_t stagingBytes = 0;  // released when the entry is retired
  };
  bool reducesThisBackward() const;
  void launch(size_t bucket);
  // Waits for one reduction, runs its completion and releases what it held.
  void retire(InFlight& f);
  void retireCompleted();
  void retireOldest();
  void retireAll();
  void countStaging(int64_t bytes);
  void registerHooks();
  void removeHooks();

  std::vector<Bucket>& buckets_;
  Communicator& comm_;
  ShardingPlan plan_;
  bool inBackward_ = false;
  bool boundary_ = false;
  std::vector<std::vector<char>> ready_;
  std::vector<size_t> readyCount_;
  std::vector<char> launched_;
  std::vector<char> shardHasData_;
  std::vector<InFlight> inFlight_;
  ReductionOptions options_;
  int64_t liveStagingBytes_ = 0;
  int64_t peakStagingBytes_ = 0;
  struct HookHandle;
  std::vector<std::unique_ptr<HookHandle>> hooks_;
};

} // namespace zeroshard
