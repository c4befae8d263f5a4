// What the gradient reducer's tests share (tests/cpp/grad/test_grad_*.cpp): the expected
// optimizer gradient, exact comparison, collective counts, one micro-batch through a reducer,
// and storage for a plan.
#pragma once

#include "grad_model.h"
#include "zeroshard/comm/communicator.h"
#include "zeroshard/grad/grad_reducer.h"
#include "zeroshard/grad/grad_storage.h"
#include "zeroshard/layout/bucket.h"
#include "zeroshard/plan/sharding_plan.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace zeroshard::testing {

// What optimizerGrad(b) must hold: the whole flat buffer when the optimizer is replicated, this
// rank's shard of it otherwise.
inline at::Tensor expectedOptimizerGrad(const zeroshard::ShardingPlan& plan, const std::vector<zeroshard::Bucket>& buckets, size_t b,
                                 const std::vector<int>& micros, int world, int rank,
                                 const std::set<std::string>& skip = {}) {
  auto flat = expectedFlat(buckets, b, micros, world, skip);
  if (!plan.optimizerSharded()) return flat;
  const auto range = buckets[b].layout().shardRange(rank);
  return flat.narrow(0, range.begin, range.numel());
}

inline bool sameValues(const at::Tensor& actual, const at::Tensor& expected) {
  return actual.sizes() == expected.sizes() && at::equal(actual.to(at::kDouble), expected);
}

inline int64_t calls(const zeroshard::Communicator& comm, zeroshard::CollectiveKind kind) {
  return comm.stats()[kind].calls;
}

inline int64_t allCalls(const zeroshard::Communicator& comm) {
  int64_t total = 0;
  for (auto kind : {zeroshard::CollectiveKind::kAllGather, zeroshard::CollectiveKind::kReduceScatter, zeroshard::CollectiveKind::kAllReduce,
                    zeroshard::CollectiveKind::kBroadcast}) {
    total += calls(comm, kind);
  }
  return total;
}

// One micro-batch through the reducer, as Engine::backward runs it.
inline void runBackward(zeroshard::GradReducer& reducer, const std::vector<zeroshard::Bucket>& buckets, bool boundary, int micro,
                 const std::set<std::string>& skip = {}) {
  reducer.beginBackward(boundary);
  lossOf(buckets, micro, /*rank=*/0, skip).backward();
  reducer.finishBackward();
}

inline int64_t bytesPerElement(at::ScalarType dtype) {
  return static_cast<int64_t>(c10::elementSize(dtype));
}

// The storage construction tests need no group: the plan, the buckets and a rank are enough.
inline std::unique_ptr<zeroshard::GradStorage> storageFor(int64_t stage, const std::vector<zeroshard::Bucket>& buckets, int rank, int world,
                                        zeroshard::GradStorageOptions options = {}) {
  return zeroshard::GradStorage::forPlan(zeroshard::ShardingPlan::forStage(stage, world), buckets, rank, options);
}

}  // namespace zeroshard::testing
