#include "zeroshard/checkpoint/held_state.h"

namespace zeroshard {

at::Tensor kindOf(const ShardedAdamW::ShardState& state, size_t kind) {
  return kind == 0 ? state.master : kind == 1 ? state.expAvg : state.expAvgSq;
}

c10::Device deviceOf(const CheckpointedState& s) {
  return s.buckets.front().flatParams().device();
}

ShardRange heldRange(const CheckpointedState& s, size_t bucket) {
  const auto& layout = s.buckets[bucket].layout();
  return s.plan.optimizerSharded() ? layout.shardRange(s.shardRank) : ShardRange{0, layout.paddedNumel()};
}

} // namespace zeroshard
