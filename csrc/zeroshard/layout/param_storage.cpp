#include "zeroshard/layout/param_storage.h"

#include <ATen/record_function.h>
#include <algorithm>

namespace zeroshard {

void ReplicatedParams::afterStep() {
  RECORD_USER_SCOPE("zeroshard::gather_params");  // Note [profiler names]
  // Every bucket's gather is started before any is waited for.
  for (size_t b = 0; b < buckets_.size(); ++b) afterStepOf(b);
  finishAfterStep();
}

// Note [all-gather buckets]: zero_optimization.allgather_bucket_size bounds the elements one
// all-gather delivers, as in DeepSpeed's stages 1 and 2. A bucket that fits is gathered in one
// call straight into its flat buffer, waited for in finishAfterStep(); a larger one goes chunk
// by chunk, the same chunk of every rank's slice per call, each waited for before the next, so
// the backend's staging buffer stays within the bound.
void ReplicatedParams::afterStepOf(size_t bucket) {
  if (!shardedOptimizer_) return;
  auto& b = buckets_.at(bucket);
  const int64_t limit = gatherLimit_;
  const int64_t world = comm_.worldSize();
  if (b.layout().paddedNumel() <= limit) {
    pending_.push_back(comm_.allGather(b.paramShard(), b.flatParams()));
    return;
  }
  const int64_t shardNumel = b.layout().shardNumel();
  const int64_t chunk = std::max<int64_t>(1, limit / world);
  const at::Tensor shard = b.paramShard();
  for (int64_t begin = 0; begin < shardNumel; begin += chunk) {
    const int64_t length = std::min(chunk, shardNumel - begin);
    std::vector<at::Tensor> pieces;
    for (int64_t r = 0; r < world; ++r) pieces.push_back(b.flatParams().narrow(0, r * shardNumel + begin, length));
    comm_.allGatherPieces(shard.narrow(0, begin, length), pieces).wait();
  }
}

void ReplicatedParams::finishAfterStep() {
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& h : pending) h.wait();
}

int64_t ReplicatedParams::bytes() const {
  int64_t total = 0;
  for (const auto& b : buckets_) total += static_cast<int64_t>(b.flatParams().nbytes());
  return total;
}

}  // namespace zeroshard
