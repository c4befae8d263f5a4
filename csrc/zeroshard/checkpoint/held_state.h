// What this rank holds of the state an engine checkpoint saves and loads, shared by its save
// (engine_checkpoint.cpp) and load (engine_checkpoint_load.cpp) sides.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "zeroshard/checkpoint/engine_checkpoint.h"
#include "zeroshard/checkpoint/manifest.h"
#include "zeroshard/layout/flat_layout.h"
#include "zeroshard/optim/optimizer.h"

#include <cstddef>
#include <iterator>

namespace zeroshard {

// The state tensors saved per bucket: master, exp_avg, exp_avg_sq (kStateKinds' order).
constexpr size_t kNumKinds = std::size(kStateKinds);

// One parameter shard's state tensor of kind `kind` (an index into kStateKinds).
inline at::Tensor kindOf(const ShardedAdamW::ShardState& state, size_t kind) {
  return kind == 0 ? state.master : kind == 1 ? state.expAvg : state.expAvgSq;
}

// The device of the engine's buffers, where the agreements' collectives run.
inline c10::Device deviceOf(const CheckpointedState& s) {
  return s.buckets.front().flatParams().device();
}

// The range of a bucket's flat buffer this rank holds master weights and AdamW state for.
inline ShardRange heldRange(const CheckpointedState& s, size_t bucket) {
  const auto& layout = s.buckets[bucket].layout();
  return s.plan.optimizerSharded() ? layout.shardRange(s.shardRank) : ShardRange{0, layout.paddedNumel()};
}

} // namespace zeroshard
