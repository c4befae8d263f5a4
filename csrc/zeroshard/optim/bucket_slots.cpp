#include "zeroshard/optim/bucket_slots.h"

namespace zeroshard {

// Note [one optimizer slot per run]: a unit may mix param groups, so each run of consecutive
// parameter pieces of one group in this rank's shard is one optimizer slot, the last run
// reaching the shard's end. A unit of one group is then one slot over the whole shard, as a
// stage-2 bucket is: the fused AdamW kernel takes every element through its vector loop at both
// stages (a shard is a multiple of 16 elements), where a slot per parameter would send each
// one's last elements through the scalar tail, which rounds differently.
std::vector<OptimizerSlot> registerBucket(ShardedAdamW& optimizer, const Bucket& bucket, const at::Tensor& master,
                                          const at::Tensor& grad, bool splitByGroup, int rank) {
  std::vector<OptimizerSlot> slots;
  if (!splitByGroup) {
    const int group = bucket.paramGroup();
    slots.push_back({group, optimizer.addShard(group, master, grad), 0, master.numel()});
    return slots;
  }
  const auto pieces = bucket.layout().piecesInShard(rank);
  for (size_t i = 0; i < pieces.size();) {
    const int group = bucket.paramGroupOf(pieces[i].param);
    size_t next = i + 1;
    while (next < pieces.size() && bucket.paramGroupOf(pieces[next].param) == group) ++next;
    const int64_t begin = pieces[i].shardOffset;
    const int64_t end = next == pieces.size() ? bucket.layout().shardNumel() : pieces[next].shardOffset;
    const size_t index = optimizer.addShard(group, master.narrow(0, begin, end - begin), grad.narrow(0, begin, end - begin));
    slots.push_back({group, index, begin, end - begin});
    i = next;
  }
  return slots;
}

}  // namespace zeroshard
