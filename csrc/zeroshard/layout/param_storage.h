// Where the parameters live between uses, chosen by the sharding plan. The engine owns the
// buckets; the storage decides what of them exists when.
//
//   replicated (stages 0-2, ReplicatedParams below): every rank holds every bucket's full flat
//     buffer. Where the optimizer state is sharded (stages 1 and 2) each rank updates only its
//     slice, and afterStep() all-gathers the buckets.
//   sharded (stage 3, stage3/unit_scheduler.h): each rank holds its slice of every unit; a
//     unit's full buffer exists only around its forward and backward.
#pragma once

#include "zeroshard/comm/communicator.h"
#include "zeroshard/layout/bucket.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

class ParamStorage {
 public:
  virtual ~ParamStorage() = default;
  // End of a backward (stage 3: what is still gathered is released), or of one that raised.
  virtual void finishBackward() {}
  virtual void abortBackward() {}
  // The optimizer step wrote this rank's part of the parameters: make them whole where they are
  // kept whole. Blocking. The same, bucket by bucket: afterStepOf(b) starts bucket b's
  // gather (offload calls it as each bucket's update is copied back, so the gather overlaps the
  // next bucket's host step), finishAfterStep() waits for them all.
  virtual void afterStep() = 0;
  virtual void afterStepOf(size_t bucket) = 0;
  virtual void finishAfterStep() = 0;
  // Every parameter whole (blocking), and released again (gathered_parameters()).
  virtual void gatherAll() {}
  virtual void reshardAll() {}
  // Bytes of parameters held between steps, and of those in host memory (offload_param).
  virtual int64_t bytes() const = 0;
  virtual int64_t hostBytes() const { return 0; }
  // The most bytes of gathered parameters alive at once since resetPeak() (stage 3).
  virtual int64_t peakGatheredBytes() const { return 0; }
  // The same for hpZ's secondary shards (stage 3).
  virtual int64_t peakSecondaryBytes() const { return 0; }
  virtual void resetPeak() {}
};

// Stages 0-2.
class ReplicatedParams final : public ParamStorage {
 public:
  // `shardedOptimizer`: each rank updates its slice only (stages 1 and 2). `gatherLimit`: the
  // most elements one all-gather delivers (zero_optimization.allgather_bucket_size).
  ReplicatedParams(std::vector<Bucket>& buckets, Communicator& comm, bool shardedOptimizer, int64_t gatherLimit)
      : buckets_(buckets), comm_(comm), shardedOptimizer_(shardedOptimizer), gatherLimit_(gatherLimit) {}
  void afterStep() override;
  void afterStepOf(size_t bucket) override;
  void finishAfterStep() override;
  int64_t bytes() const override;

 private:
  std::vector<Bucket>& buckets_;
  std::vector<CommHandle> pending_;
  Communicator& comm_;
  bool shardedOptimizer_;
  int64_t gatherLimit_;
};

}  // namespace zeroshard
