// Where each bucket's optimizer state lives: the shards registered with ShardedAdamW.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/layout/bucket.h"
#include "zeroshard/optim/optimizer.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

// One registered shard of a bucket: its param group, its index within the group, and the
// elements it covers, by offset within the range the bucket's master weights cover.
struct OptimizerSlot {
  int group;
  size_t index;
  int64_t offset;
  int64_t numel;
};

// Registers the bucket's `master` weights with `grad` (the gradients over the same range). One
// slot over the whole range when the bucket is one param group; with `splitByGroup` (stage-3
// units, which may mix groups) one per run of consecutive parameters of one group in this
// rank's shard (Note [one optimizer slot per run]).
std::vector<OptimizerSlot> registerBucket(ShardedAdamW& optimizer, const Bucket& bucket, const at::Tensor& master,
                                          const at::Tensor& grad, bool splitByGroup, int rank);

}  // namespace zeroshard
